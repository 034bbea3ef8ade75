"""Bad input is refused at the door, naming the field; the engine and other requests go on."""

from __future__ import annotations

import math

import pytest

from radixkv import BeamSearchParams, Engine, SamplingParams

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": NAN}, "temperature"),
        ({"temperature": INF}, "temperature"),
        ({"temperature": "0"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": NAN}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop": "abc"}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2.0}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"length_penalty": "x"}, "length_penalty"),
        ({"length_penalty": NAN}, "length_penalty"),
        ({"length_penalty": -INF}, "length_penalty"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"early_stopping": 1}, "early_stopping"),
        ({"ignore_eos": 0}, "ignore_eos"),
    ],
)
def test_bad_beam_search_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


@pytest.fixture(scope="module")
def engine(model_folders) -> Engine:
    kw = {"block_size": 4, "kv_cache_memory": "1MiB", "max_num_seqs": 8}
    return Engine.from_pretrained(model_folders["llama"], **kw)


def test_params_changed_after_construction_are_checked_at_submission(engine):
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    beam = BeamSearchParams(beam_width=2)
    beam.length_penalty = "x"  # once accepted, then failed inside a step and stranded others
    with pytest.raises(ValueError, match="length_penalty"):
        engine.add_request([1, 2, 3], beam)
    sampling = SamplingParams()
    sampling.temperature = NAN
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1, 2, 3], sampling)
    engine.run_until(lambda: engine.is_finished(good))
    assert len(engine.output(good).token_ids) == 3
    engine.check_invariants()


def test_a_params_object_changed_after_submission_does_not_reach_the_request(engine):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    rid = engine.add_request([5, 6, 7], params)
    params.max_tokens = 50
    engine.run_until(lambda: engine.is_finished(rid))
    assert len(engine.output(rid).token_ids) == 3


def test_the_wrong_params_class_is_a_type_error_naming_it(engine):
    with pytest.raises(TypeError, match="BeamSearchParams"):
        engine.generate([[1, 2, 3]], BeamSearchParams())
    with pytest.raises(TypeError, match="BeamSearchParams"):
        engine.stream([1, 2, 3], BeamSearchParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.beam_search([1, 2, 3], SamplingParams())
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        (SamplingParams(n=9), "max_num_seqs"),
        (BeamSearchParams(beam_width=9), "max_num_seqs"),
    ],
)
def test_what_only_the_engine_can_check_is_checked_at_the_door(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.add_request([1, 2, 3], params)
    assert not engine.has_unfinished_requests()


def test_request_ids_must_be_unique_among_live_requests(engine):
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="a")
    engine.run_until(lambda: engine.is_finished(rid))
    engine.output(rid)
    assert engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="a") == "a"  # free again
    engine.abort("a")
    engine.output("a")
