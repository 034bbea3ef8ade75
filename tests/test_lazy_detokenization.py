"""Text is made where outputs are read, not in the engine's step, except where a stop string
must be found; the text equals the tokenizer's own decode of the ids, and a stop string still
ends its request at the token that completes it."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from conftest import SMALL_POOL

from radixkv import AsyncEngine, Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def engine(small_llama_engine) -> Engine:
    return small_llama_engine


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(rng.randrange(4, 12))]


class DecodeCalls:
    """Counts the engine's decode calls (`InputProcessor.decode`, its one way to text) inside
    and outside `engine.step`."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decode = engine.tokenizer.decode  # the oracle: transformers' own decode
        self.in_step = False
        self.step_calls = self.reader_calls = 0
        step, engine_decode = engine.step, engine.inputs.decode

        def counting(ids):
            if self.in_step:
                self.step_calls += 1
            else:
                self.reader_calls += 1
            return engine_decode(ids)

        def flagged_step():
            self.in_step = True
            try:
                return step()
            finally:
                self.in_step = False

        monkeypatch.setattr(engine.inputs, "decode", counting)
        monkeypatch.setattr(engine, "step", flagged_step)

    def text(self, ids: list[int]) -> str:
        return self.decode(ids, skip_special_tokens=True)


def test_steps_make_no_text_without_stop_strings_and_the_text_is_the_tokenizers(engine, monkeypatch):
    calls = DecodeCalls(engine, monkeypatch)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True),  # splits characters
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True),
    ]
    outs = [engine.generate([prompt(i)], p)[0] for i, p in enumerate(params)]
    deltas = list(engine.stream(prompt(9), params[1]))
    assert calls.step_calls == 0, "a step decoded text that no stop string needed"
    assert calls.reader_calls > 0
    for out in outs:
        for sample in out.samples:
            assert sample.text == calls.text(sample.token_ids)
    assert "".join(d.text for d in deltas) == calls.text([d.token_id for d in deltas])
    assert any("\ufffd" in calls.text(s.token_ids[:k]) for s in outs[1].samples for k in range(16)), (
        "no output ended inside a multi-byte character: the window logic was not exercised"
    )
    engine.check_invariants()


@pytest.mark.slow
def test_a_stop_string_ends_the_request_at_the_token_that_completes_it(engine, monkeypatch):
    exercised = 0
    for seed in range(6):
        p = [ord(c) for c in f"story {seed}: "]
        full = engine.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
        text = full.text
        spans = [text[i : i + 3] for i in range(2, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
        if not spans:
            continue
        stop = spans[len(spans) // 2]
        # The oracle: the shortest prefix of the ids whose decode holds the stop string.
        calls = DecodeCalls(engine, monkeypatch)
        end = next(k for k in range(1, len(full.token_ids) + 1) if stop in calls.text(full.token_ids[:k]))
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        for out in engine.generate([p, p], params):
            assert out.token_ids == full.token_ids[:end] and out.finish_reason == "stop"
            assert out.text == text[: text.index(stop)]
        assert calls.step_calls > 0, "the stop string was not looked for in the step"
        exercised += 1
        monkeypatch.undo()
    assert exercised >= 3
    engine.check_invariants()


def test_async_texts_are_made_in_the_callers_thread(model_folders):
    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=model_folders["llama"], **SMALL_POOL))
        inputs = engine.core.inputs  # the front end's (the core makes no text)
        decode, engine_decode, threads = engine.tokenizer.decode, inputs.decode, set()

        def recording(ids):
            threads.add(threading.current_thread())
            return engine_decode(ids)

        inputs.decode = recording
        try:
            params = SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
            deltas = [d async for d in engine.stream(prompt(1), params)]
            out = await engine.generate(prompt(1), params)
        finally:
            await engine.shutdown()
        assert threads == {threading.current_thread()}, "text was made outside the caller's thread"
        ids = [d.token_id for d in deltas]
        assert ids == out.token_ids
        assert "".join(d.text for d in deltas) == decode(ids, skip_special_tokens=True) == out.text

    asyncio.run(main())
