"""The `session` policy in the engine: a live chat's conversation outlives newer one-off requests
in a squeezed pool, where LRU drops it; closing the chat gives its blocks up first."""

from __future__ import annotations

import asyncio
import random

import pytest

from radixkv import AsyncEngine, Engine, EngineConfig, SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def squeezed(model_folders, eviction: str) -> Engine:
    """12 blocks of 16 tokens (8 KiB each for the tiny llama)."""
    folder = model_folders["llama"]
    return Engine.from_pretrained(folder, block_size=16, kv_cache_memory=12 * 8192, eviction=eviction)


def one_offs(engine: Engine, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(4):  # three blocks each: together they fill the 12-block pool
        engine.generate([[rng.randrange(256) for _ in range(36)]], PARAMS)


@pytest.mark.parametrize(("eviction", "kept"), [("lru", False), ("session", True)])
def test_a_live_chat_outlives_newer_one_off_requests_only_under_the_session_policy(
    model_folders, eviction, kept
):
    engine = squeezed(model_folders, eviction)
    assert engine.pool.num_blocks == 12
    engine.step_hooks.append(Engine.check_invariants)
    system = [random.Random(1).randrange(256) for _ in range(40)]
    with engine.chat(system=system) as chat:
        first = chat.send([7] * 16, PARAMS)
        one_offs(engine, seed=2)
        second = chat.send([9] * 4, PARAMS)
    earlier = len(first.prompt_token_ids) + len(first.token_ids)
    assert (second.num_cached_tokens >= earlier - 16) is kept
    assert chat.closed
    with pytest.raises(ValueError, match="closed"):
        chat.send([1], PARAMS)


def test_a_closed_chat_gives_its_blocks_up_before_one_off_requests(model_folders):
    engine = squeezed(model_folders, "session")
    chat = engine.chat(system=[3] * 40)
    out = chat.send([7] * 16, PARAMS)
    conversation = out.prompt_token_ids + out.token_ids
    engine.generate([[5] * 36], PARAMS)  # a one-off request, newer than the chat's turn
    chat.close()
    one_offs(engine, seed=4)
    assert engine.kv.cache.cached_prefix_len(conversation) == 0
    engine.check_invariants()


@pytest.mark.parametrize("close", [False, True])
def test_an_async_chat_is_tagged_and_closed_like_a_chat(model_folders, close):
    """`AsyncEngine.chat()` turns carry the session, and its `close()` (queued, not waited for)
    reaches the policy before the next step: the same outcome as the two tests above."""

    async def main() -> tuple[int, int]:
        config = EngineConfig(
            model=str(model_folders["llama"]), block_size=16, kv_cache_memory=12 * 8192, eviction="session"
        )
        engine = AsyncEngine(config, engine_process=False)  # reads the core's cache below
        try:
            chat = engine.chat(system=[3] * 40)
            first = await chat.send([7] * 16, PARAMS)
            if close:
                chat.close()
            rng = random.Random(2)
            for _ in range(4):
                await engine.generate([rng.randrange(256) for _ in range(36)], PARAMS)
            engine.check_invariants()
            conversation = first.prompt_token_ids + first.token_ids
            return engine.core.kv.cache.cached_prefix_len(conversation), len(conversation)
        finally:
            await engine.shutdown()

    kept, length = asyncio.run(main())
    assert (kept >= length - 16) is not close
    assert (kept == 0) is close
