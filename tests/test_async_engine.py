"""AsyncEngine: many concurrent streams with cancellations, against the blocking engine's outputs.
The engine core runs in its own process (the default) unless a test says `engine_process=False`
(in-process tests reach into the core, or test the loop thread itself).

The sync `Engine` on the same weights is the oracle here; it is itself checked against
transformers in test_engine.py. Seeded sampling does not depend on the batch, so every surviving
output must equal the sync engine's whatever else ran beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import sys
import threading
import time

import pytest

from radixkv import AsyncEngine, BeamSearchParams, Engine, EngineConfig, SamplingParams, StreamDelta
from radixkv.engine.process.core_client import CoreClient

KW = {"block_size": 4, "kv_cache_memory": "8MiB"}


def parked(thread: threading.Thread) -> bool:
    """Whether `thread` is blocked in `threading.Event.wait` (its innermost frames)."""
    frame = sys._current_frames().get(thread.ident)
    names = []
    while frame is not None and len(names) < 4:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "wait" in names


async def until(done, timeout_s: float = 30.0) -> None:
    """Polls `done()` until it holds; fails the test if it does not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not done within {timeout_s} s"
        await asyncio.sleep(0.01)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(12)]
    out = []
    for _ in range(n):
        out.append(shared[: rng.randrange(0, 12)] + [rng.randrange(256) for _ in range(rng.randrange(2, 10))])
    return out


def params_for(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=6, temperature=0.9, seed=i, ignore_eos=True)


def leak_free(core) -> None:
    """No block, table or request left behind. A core in its own process is asked: once it is
    idle, its invariants (every block held by the cache or a running sequence) and no request."""
    if isinstance(core, CoreClient):
        deadline = time.monotonic() + 30
        while (m := core.metrics())["running"] or m["waiting"]:
            assert time.monotonic() < deadline, "the core did not become idle within 30 s"
            time.sleep(0.01)
        core.check_invariants()
        assert not core._requests
        return
    core.check_invariants()
    cache = core.kv.cache
    assert core.pool.num_free + cache.evictable_size == core.pool.num_blocks
    assert core.kv.num_live_tables() == 0
    assert not core._requests


@pytest.mark.parametrize("engine_process", [True, False], ids=["core-process", "in-process"])
def test_64_streams_with_random_cancellations_equal_the_sync_engine(model_folders, engine_process):
    batch = prompts(64, seed=1)
    sync = Engine.from_pretrained(model_folders["llama"], **KW)
    ids = [sync.add_request(p, params_for(i)) for i, p in enumerate(batch)]
    sync.run_until(lambda: not sync.has_unfinished_requests())
    expected = [sync.output(i).token_ids for i in ids]
    rng = random.Random(2)
    cancel_after = {i: rng.randrange(0, 4) for i in rng.sample(range(64), 16)}  # deltas, then cancel
    break_after = {i: rng.randrange(1, 4) for i in rng.sample(sorted(set(range(64)) - set(cancel_after)), 8)}

    async def main() -> tuple[dict[int, list[StreamDelta]], AsyncEngine]:
        config = EngineConfig(model=str(model_folders["llama"]), **KW)
        engine = AsyncEngine(config, engine_process=engine_process)
        got: dict[int, list[StreamDelta]] = {}
        started: dict[int, asyncio.Event] = {i: asyncio.Event() for i in cancel_after}

        async def consume(i: int) -> None:
            got[i] = []
            async with contextlib.aclosing(engine.stream(batch[i], params_for(i))) as stream:
                async for delta in stream:
                    got[i].append(delta)
                    if i in cancel_after and len(got[i]) >= cancel_after[i]:
                        started[i].set()
                    if i in break_after and len(got[i]) == break_after[i]:
                        break  # aclosing closes the stream, which aborts the request

        tasks = {i: asyncio.create_task(consume(i)) for i in range(64)}

        async def canceller(i: int) -> None:
            await started[i].wait()
            tasks[i].cancel()

        cancellers = [asyncio.create_task(canceller(i)) for i in cancel_after]
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        await asyncio.gather(*cancellers)
        for i, r in zip(tasks, results, strict=True):
            assert r is None or isinstance(r, asyncio.CancelledError), (i, r)
        if not engine_process:
            engine.core.step()  # applies the aborts the cancellations queued (a no-op if the loop did)
        return got, engine

    got, engine = asyncio.run(main())
    cancelled = 0
    for i, deltas in got.items():
        tokens = [d.token_id for d in deltas]
        if i in cancel_after or i in break_after:
            assert tokens == expected[i][: len(tokens)]
            cancelled += len(tokens) < len(expected[i])
        else:
            assert tokens == expected[i]
            assert deltas[-1].finish_reason == "length"
            assert "".join(d.text for d in deltas) == sync.decode(tokens)
    assert cancelled > 0, "no request was cut short: the cancellations exercised nothing"
    leak_free(engine.core)
    asyncio.run(engine.shutdown())


def test_generate_beam_search_and_cancellation(model_folders):
    prompt = prompts(1, seed=3)[0]
    sync = Engine.from_pretrained(model_folders["llama"], **KW)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    beam = BeamSearchParams(beam_width=3, max_tokens=6)
    want = sync.generate([prompt], greedy)[0]
    want_beams = sync.beam_search(prompt, beam)

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=str(model_folders["llama"]), **KW))
        out = await engine.generate(prompt, greedy, request_id="mine")
        assert out.request_id == "mine" and out.token_ids == want.token_ids and out.text == want.text
        beams = await engine.beam_search(prompt, beam)
        assert [b.token_ids for b in beams] == [b.token_ids for b in want_beams]
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(engine.generate(prompt, long, request_id="slow"))
        await until(lambda: engine.metrics()["running"] > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        wide = BeamSearchParams(beam_width=3, max_tokens=60)
        beam_task = asyncio.create_task(engine.beam_search(prompt, wide))
        await until(lambda: engine.metrics()["running"] > 0)
        beam_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await beam_task
        with pytest.raises(TypeError, match="BeamSearchParams"):
            await engine.generate(prompt, beam)
        with pytest.raises(ValueError, match="request_id"):
            await engine.generate(prompt, greedy, request_id="")
        stream = engine.stream(prompt, long)  # dropped after one delta: garbage collection aborts it
        assert (await anext(stream)).token_id == want.token_ids[0]
        del stream
        gc.collect()
        await until(lambda: (m := engine.metrics())["running"] == 0 and m["waiting"] == 0)
        chat = engine.chat(system=[1, 2, 3])
        first = await chat.send([4, 5, 6], greedy)
        second = await chat.send([7, 8], greedy)
        assert second.num_cached_tokens >= len(first.prompt_token_ids)
        leak_free(engine.core)
        await engine.shutdown()

    asyncio.run(main())


def test_an_idle_engine_sleeps(model_folders):
    """Idle, the loop thread is parked on its event (no polling), so it uses no CPU."""

    async def main() -> float:
        engine = AsyncEngine(EngineConfig(model=str(model_folders["llama"]), **KW), engine_process=False)
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        await until(lambda: parked(engine.loop_thread))
        clock = time.pthread_getcpuclockid(engine.loop_thread.ident)
        before = time.clock_gettime(clock)
        await asyncio.sleep(0.2)  # a window to measure the parked thread's CPU over, not a wait
        used = time.clock_gettime(clock) - before
        assert parked(engine.loop_thread)
        out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out.token_ids) == 2  # and it wakes on submission
        await engine.shutdown()
        assert not engine.loop_thread.is_alive()
        return used

    assert asyncio.run(main()) < 0.005, "the loop thread used CPU while idle"


@pytest.mark.parametrize("engine_process", [True, False], ids=["core-process", "in-process"])
def test_shutdown_aborts_what_is_in_flight(model_folders, engine_process):
    async def main() -> None:
        config = EngineConfig(model=str(model_folders["llama"]), **KW)
        engine = AsyncEngine(config, engine_process=engine_process)
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(engine.generate([1, 2, 3], long))
        await until(lambda: engine.metrics()["running"] > 0)
        await engine.shutdown()
        out = await task
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 500
        if engine_process:
            assert engine.core.process.poll() is not None  # the core process is gone, and its blocks
        else:
            leak_free(engine.core)
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.generate([1, 2, 3], long)

    asyncio.run(main())
