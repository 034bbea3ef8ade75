"""Hostile parameters: every field checked at the door against what the sampler and the beam
scorer can take, and an error in one request's sampling or beam scoring failing that request
alone.

Edge values come from `hypothesis` (plus the values that once broke a step: 2**63, 2**64, 1e-45,
1e-300, 1e10, -1e308): each is a ValueError naming its field, or params that sample a valid token
(greedy below a temperature of 1e-5) and score beams finitely. Over HTTP, each reproduction is
answered as it should be while a neighbour's greedy output stays what it is alone; in the engine,
a fault injected into one request's sampling or beam step fails that request and no other.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv import AsyncEngine, BeamSearchParams, Engine, EngineConfig, RequestError, SamplingParams
from radixkv.sampling.sampler import make_generator, sample
from radixkv.sampling_params import GREEDY_BELOW_TEMPERATURE, MAX_LENGTH_PENALTY
from radixkv.scheduler import step_sampling
from radixkv.scheduler.beam_search import BeamSearch

VOCAB = 259
BROKE_A_STEP = [0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]
TINY_AND_HUGE = [1e-45, 1e-300, 5e-324, 9.99e-6, 1e-5, 1e10, 1e308, -1e308, -0.0]
INTS = st.one_of(st.integers(), st.sampled_from(BROKE_A_STEP))
FLOATS = st.one_of(st.floats(), st.sampled_from(TINY_AND_HUGE), st.integers(-5, 5))
SAMPLING_FIELDS = {
    "max_tokens": INTS,
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS,
    "seed": INTS,
    "n": INTS,
}


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn((1, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(SAMPLING_FIELDS)), st.data())
def test_every_sampling_value_is_refused_naming_its_field_or_samples_a_valid_token(field, data):
    value = data.draw(SAMPLING_FIELDS[field], label=field)
    try:
        params = SamplingParams(**{field: value})
    except ValueError as error:
        assert str(error).startswith(field)
        return
    logits = _logits()
    generator = None if params.seed is None else make_generator(params.seed, "cpu")
    token = int(sample(logits, [params], [generator])[0])
    assert token in _allowed(logits[0], params)


def _allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The tokens `params` may pick, in float64: the argmax when greedy, else the top `top_k` cut to
    the fewest whose probability (at the temperature) reaches `top_p`, never fewer than one."""
    order = logits.double().argsort(descending=True).tolist()
    if params.temperature < GREEDY_BELOW_TEMPERATURE:
        return {order[0]}
    kept = order[: params.top_k] if params.top_k != -1 else order
    probs = torch.softmax(logits.double()[kept] / params.temperature, dim=-1).tolist()
    allowed, mass = set(), 0.0
    for token, p in zip(kept, probs, strict=True):
        allowed.add(token)
        mass += p
        if mass >= params.top_p + 1e-6:  # float32 in the sampler: a token at the edge may go either way
            break
    return allowed


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.one_of(st.floats(), st.sampled_from(TINY_AND_HUGE)))
def test_every_length_penalty_is_refused_or_scores_beams_finitely(length_penalty):
    try:
        params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=length_penalty)
    except ValueError as error:
        assert str(error).startswith("length_penalty")
        return
    # The bound's claim: a float32 score of 1e8 over any length up to 2**20 stays finite.
    for length in (1, 2, 2**20):
        score = torch.tensor(-1e8, dtype=torch.float32) / (float(length) ** length_penalty)
        assert torch.isfinite(score)
    assert abs(params.length_penalty) <= MAX_LENGTH_PENALTY
    search = BeamSearch(params, [VOCAB - 1], 4)
    outputs: list[list[int]] = [[]]
    for step in range(4):
        rows = torch.log_softmax(_logits(step).expand(len(outputs), VOCAB), dim=-1)
        continuations = search.step(rows, outputs)
        if search.done:
            break
        outputs = [outputs[0 if len(outputs) == 1 else c.parent] + [c.token] for c in continuations]
    assert all(math.isfinite(score) for _, score in search.results())


def test_a_top_k_above_the_vocabulary_keeps_the_whole_vocabulary():
    logits = _logits()
    for seed in range(5):
        whole = sample(logits, [SamplingParams(seed=seed)], [make_generator(seed, "cpu")])
        huge = sample(logits, [SamplingParams(seed=seed, top_k=2**63 - 1)], [make_generator(seed, "cpu")])
        assert torch.equal(whole, huge)


# ------------------------------------------------------------------------- in the engine

KW = {"block_size": 4, "kv_cache_memory": "8MiB", "max_num_batched_tokens": 64, "max_num_seqs": 8}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
POISON_SEED = 6_666_666
POISON_PENALTY = 0.625
NEIGHBOURS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 100, 3, 100, 3]]


class Fault(RuntimeError):
    pass


def _no_leaks(engine: Engine) -> None:
    engine.check_invariants()
    assert engine.kv.num_live_tables() == 0 and engine.kv.pending_copies == []
    assert engine.pool.num_free + engine.kv.cache.evictable_size == engine.pool.num_blocks


@pytest.fixture(scope="module")
def alone(model_folders) -> list[list[int]]:
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    return [out.token_ids for out in engine.generate(NEIGHBOURS, GREEDY)]


def test_a_request_whose_sampling_raises_fails_alone_and_its_step_goes_on(model_folders, alone, monkeypatch):
    real = step_sampling.sample

    def poisoned(logits, params, generators, *rest):
        if any(p.seed == POISON_SEED for p in params):
            raise Fault("this request's parameters broke the sampler")
        return real(logits, params, generators, *rest)

    monkeypatch.setattr(step_sampling, "sample", poisoned)
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    bad = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=6, seed=POISON_SEED, n=2))
    good = [engine.add_request(p, GREEDY) for p in NEIGHBOURS]
    engine.run_until(lambda: all(engine.is_finished(r) for r in [bad, *good]))
    with pytest.raises(RequestError) as raised:
        engine.output(bad)
    assert isinstance(raised.value.__cause__, Fault)
    assert [engine.output(r).token_ids for r in good] == alone
    _no_leaks(engine)
    # The engine goes on: the same prompts again give the same tokens.
    assert [out.token_ids for out in engine.generate(NEIGHBOURS, GREEDY)] == alone


def test_a_beam_request_whose_scoring_raises_fails_alone(model_folders, alone, monkeypatch):
    real = BeamSearch.step

    def poisoned(self, logprobs, outputs):
        if self.params.length_penalty == POISON_PENALTY:
            raise Fault("this request's beams could not be scored")
        return real(self, logprobs, outputs)

    monkeypatch.setattr(BeamSearch, "step", poisoned)
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    poisoned_params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=POISON_PENALTY)
    bad = engine.add_request([7, 8, 9], poisoned_params)
    fine = engine.add_request([7, 8, 9], BeamSearchParams(beam_width=2, max_tokens=4))
    good = [engine.add_request(p, GREEDY) for p in NEIGHBOURS]
    engine.run_until(lambda: all(engine.is_finished(r) for r in [bad, fine, *good]))
    with pytest.raises(RequestError):
        engine.result(bad)
    assert len(engine.result(fine)) == 2
    assert [engine.output(r).token_ids for r in good] == alone
    _no_leaks(engine)


# -------------------------------------------------------------------------------- over HTTP


def _app(folder, **engine_kw):
    """An in-process app over a small engine (`max_waiting` 4): its loop, httpx client, engine."""
    import httpx

    from radixkv.server.app import build_app

    loop = asyncio.new_event_loop()
    engine = AsyncEngine(EngineConfig(model=str(folder), **{**KW, **engine_kw}))
    app = build_app(engine, "tiny", max_waiting=4, session_idle_timeout_s=0)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://radixkv")
    return loop, http, engine


def _close(loop, http, engine) -> None:
    loop.run_until_complete(http.aclose())
    loop.run_until_complete(engine.shutdown())
    loop.close()


@pytest.fixture(scope="module")
def server(model_folders):
    loop, http, engine = _app(model_folders["llama"])
    yield loop, http
    _close(loop, http, engine)


@pytest.fixture(scope="module")
def short_server(model_folders):
    """The same with `max_model_len` 12: any valid `max_tokens` ends within a few tokens."""
    loop, http, engine = _app(model_folders["llama"], max_model_len=12)
    yield loop, http
    _close(loop, http, engine)


def _post(server, body: dict) -> tuple[int, dict | str]:
    loop, http = server

    async def call():
        body.setdefault("model", "tiny")
        response = await http.post("/v1/completions", json=body)
        if body.get("stream") and response.status_code == 200:
            return 200, response.text
        return response.status_code, response.json()

    return loop.run_until_complete(call())


def _tokens(reply: dict) -> list[list[str]]:
    return [choice["text"] for choice in reply["choices"]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_k": 2**63}, "top_k"),
        ({"use_beam_search": True, "n": 2, "length_penalty": 1e10}, "length_penalty"),
        ({"use_beam_search": True, "n": 2, "length_penalty": -1e308}, "length_penalty"),
        ({"stream": True, "n": 0}, "n"),
        ({"stream": True, "n": -1}, "n"),
        ({"n": 0}, "n"),
        ({"seed": 2**64}, "seed"),
        ({"n": 1.5}, "n"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"prompt": [[1, 2]] * 5}, "prompt"),  # five sequences where 4 may wait
        ({"n": 5}, "n"),
    ],
)
def test_each_hostile_field_is_a_400_naming_it(server, extra, param):
    status, reply = _post(server, {"prompt": [1, 2, 3], "max_tokens": 2, **extra})
    assert status == 400, reply
    assert reply["error"]["param"] == param


def test_edge_values_that_are_valid_give_the_outputs_they_mean(server):
    base = {"prompt": [9, 8, 7, 6], "max_tokens": 5, "ignore_eos": True}
    greedy = _tokens(_post(server, {**base, "temperature": 0})[1])
    for extra in ({"temperature": 1e-45}, {"temperature": 9e-6, "seed": 3}, {"top_p": 1e-300, "seed": 1}):
        status, reply = _post(server, {**base, **extra})
        assert status == 200 and _tokens(reply) == greedy, extra
    status, reply = _post(server, {**base, "n": 1.0, "temperature": 0})
    assert status == 200 and _tokens(reply) == greedy
    seeded = {**base, "seed": 2**64 - 1, "n": 3}  # samples 1 and 2 wrap around to seeds 0 and 1
    whole = _post(server, seeded)[1]["choices"]
    assert whole == _post(server, seeded)[1]["choices"] and len(whole) == 3
    status, streamed = _post(server, {**seeded, "stream": True})
    assert status == 200 and streamed.endswith("data: [DONE]\n\n")
    texts = ["", "", ""]
    for line in streamed.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in whole]
    whole, huge = (_post(server, {**base, "seed": 5, "top_k": k})[1] for k in (-1, 2**63 - 1))
    assert _tokens(whole) == _tokens(huge)


JSON_EDGES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(BROKE_A_STEP + TINY_AND_HUGE + [1.0, 2.0, 0.5, True, False, None, "1", [], {}]),
    st.floats(allow_nan=False, allow_infinity=False),
)
BODY_FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "logprobs",
    "stop_token_ids",
    "length_penalty",
    "best_of",
    "stream",
]


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(field=st.sampled_from(BODY_FIELDS), value=JSON_EDGES, beams=st.booleans())
def test_every_body_field_is_a_400_naming_it_or_a_valid_completion(short_server, field, value, beams):
    server = short_server
    body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 2, field: value}
    if beams and field != "stream":
        body.update(use_beam_search=True, n=body.get("n", 2) if field == "n" else 2)
    status, reply = _post(server, body)
    if status == 400:
        assert reply["error"]["param"] in (field, "prompt"), (body, reply)  # "prompt": too many sequences
        return
    assert status == 200, (body, reply)
    if body.get("stream") is True:
        assert reply.endswith("data: [DONE]\n\n")
        return
    choices = reply["choices"]
    assert choices and all(isinstance(c["text"], str) for c in choices)
    assert reply["usage"]["completion_tokens"] <= len(choices) * max(body["max_tokens"], 1)
