"""Abort at every stage of a request's life, and the blocking calls that abort when interrupted.

After each abort no block is held by a request (the cache may keep what was computed), the
output says "abort", and the engine goes on to give the outputs a fresh engine gives.
"""

from __future__ import annotations

import random

import pytest

from radixkv import BeamSearchParams, Engine, SamplingParams
from radixkv.scheduler.request import Status

KW = {"block_size": 4, "kv_cache_memory": "8MiB", "max_num_batched_tokens": 16}
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def nothing_held(engine: Engine) -> None:
    engine.check_invariants()
    assert engine.kv.num_live_tables() == 0
    assert engine.pool.num_free + engine.kv.cache.evictable_size == engine.pool.num_blocks


SHORT = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def fresh_outputs(model_folders) -> list[list[int]]:
    """What a fresh engine gives for the bystander prompt and for the prompt aborted mid-prefill."""
    fresh = Engine.from_pretrained(model_folders["llama"], **KW)
    return [o.token_ids for o in fresh.generate([prompt(9, 12), prompt(2, 40)], SHORT)]


@pytest.fixture
def engine(model_folders) -> Engine:
    e = Engine.from_pretrained(model_folders["llama"], **KW)
    e.step_hooks.append(Engine.check_invariants)
    return e


def stage_queued(engine: Engine) -> str:
    return engine.add_request(prompt(1), LONG)


def stage_mid_prefill(engine: Engine) -> str:
    rid = engine.add_request(prompt(2, 40), LONG)  # 40 tokens at 16 a step: three chunks
    engine.step()
    request = engine._requests[rid]
    assert request.status is Status.RUNNING and not request.prompt_done
    return rid


def stage_decoding(engine: Engine) -> str:
    rid = engine.add_request(prompt(3, 8), LONG)
    for _ in range(4):
        engine.step()
    assert len(engine._requests[rid].seqs[0].output_ids) >= 2
    return rid


def stage_forks(engine: Engine) -> str:
    rid = engine.add_request(prompt(4, 8), SamplingParams(max_tokens=40, n=3, seed=1, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert len(engine._requests[rid].seqs) == 3
    return rid


def stage_beams(engine: Engine) -> str:
    rid = engine.add_request(prompt(5, 8), BeamSearchParams(beam_width=3, max_tokens=40))
    for _ in range(3):
        engine.step()
    assert len(engine._requests[rid].seqs) == 3
    return rid


@pytest.mark.parametrize("stage", [stage_queued, stage_mid_prefill, stage_decoding, stage_forks, stage_beams])
def test_abort_at_every_stage_frees_the_requests_blocks(engine, fresh_outputs, stage):
    other = engine.add_request(prompt(9, 12), SHORT)
    rid = stage(engine)
    engine.abort(rid)
    assert engine.is_finished(rid)
    request = engine._requests[rid]
    if request.is_beam_search:
        assert engine.beam_output(rid) == []
    else:
        out = engine.output(rid)
        assert {s.finish_reason for s in out.samples} == {"abort"}
        assert len(out.samples) == request.width or stage is stage_queued
    engine.run_until(lambda: engine.is_finished(other))
    assert engine.output(other).token_ids == fresh_outputs[0]
    nothing_held(engine)
    # The cache keeps only computed KV: the prompt aborted mid-prefill gives a fresh engine's tokens.
    assert engine.generate([prompt(2, 40)], SHORT)[0].token_ids == fresh_outputs[1]


def test_closing_a_stream_early_aborts_its_request(engine):
    stream = engine.stream(prompt(6), LONG)
    first = [next(stream).token_id for _ in range(2)]
    assert len(first) == 2 and engine.metrics()["running"] == 1
    stream.close()
    assert engine.metrics()["running"] == 0 and not engine._requests
    nothing_held(engine)


def test_an_interrupted_generate_aborts_what_it_submitted(engine):
    def interrupt(e: Engine) -> None:
        if e.num_steps == 3:
            raise KeyboardInterrupt

    engine.step_hooks.append(interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([prompt(7), prompt(8)], LONG)
    engine.step_hooks.remove(interrupt)
    assert not engine._requests and not engine.has_unfinished_requests()
    nothing_held(engine)


def test_aborting_an_unknown_or_finished_request_is_a_no_op(engine):
    rid = engine.add_request(prompt(10, 5), SamplingParams(max_tokens=2, temperature=0.0))
    engine.run_until(lambda: engine.is_finished(rid))
    engine.abort(rid)
    engine.abort("no-such-request")
    assert engine.output(rid).finish_reason == "length"
