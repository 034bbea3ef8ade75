"""Stop strings and per-token logprobs, end to end, against transformers on the same weights."""

from __future__ import annotations

import random

import pytest
import torch

from radixkv import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(small_llama_engine) -> Engine:
    return small_llama_engine


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(rng.randrange(5, 15))]


@pytest.mark.slow
def test_a_stop_string_across_tokens_ends_the_text_before_it(engine):
    exercised = 0
    for seed in range(4):
        p = prompt(seed)
        full = engine.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
        text = full.text
        whole = [text[i : i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
        if not whole:
            continue
        stop = whole[0]
        exercised += 1
        cut = text.index(stop)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        out = engine.generate([p], params)[0]
        assert out.text == text[:cut] and out.finish_reason == "stop"
        assert full.token_ids[: len(out.token_ids)] == out.token_ids  # generation ended where it was found
        deltas = list(engine.stream(p, params))
        assert "".join(d.text for d in deltas) == text[:cut]
        assert deltas[-1].finish_reason == "stop"
    assert exercised >= 2
    engine.check_invariants()


def test_logprobs_equal_transformers(engine, reference_models):
    model = reference_models["llama"]
    p = prompt(7)
    out = engine.generate([p], SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))[0]
    assert len(out.samples[0].logprobs) == len(out.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([p + out.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[len(p) - 1 : -1]
    for record, row, token in zip(out.samples[0].logprobs, expected, out.token_ids, strict=True):
        assert record.token_id == token
        assert record.logprob == pytest.approx(row[token].item(), abs=1e-4)
        values, ids = row.topk(3)
        assert [t for t, _ in record.top] == ids.tolist()
        assert [v for _, v in record.top] == pytest.approx(values.tolist(), abs=1e-4)
    streamed = list(engine.stream(p, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)))
    assert [d.logprobs[0].top for d in streamed] == [[]] * 8
    want = [r.logprob for r in out.samples[0].logprobs]
    # The two runs batch differently, and float sums depend on the batch: the runner's logits stay
    # within 2e-4 of transformers' (radixkv.model.presets), so two runs' log-softmaxes (a logit
    # less a log-sum-exp, each off by at most that) agree within 2 x 2 x 2e-4.
    assert [d.logprobs[0].logprob for d in streamed] == pytest.approx(want, abs=8e-4)
    assert engine.generate([p], SamplingParams(max_tokens=2))[0].samples[0].logprobs is None
