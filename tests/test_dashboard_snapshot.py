"""The tree snapshot against a naive model: the cached sequences' distinct prefixes."""

import asyncio
import json
import random

import pytest

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.salt import salt_offset, salted
from radixkv.dashboard.snapshot import tree_snapshot


def put(cache: RadixCache, tokens: list[int]) -> None:
    blocks = cache.pool.allocate(-(-len(tokens) // cache.block_size))
    cache.insert(tokens, blocks)
    for b in blocks:
        cache.pool.decref(b)
    cache.check_invariants()


def distinct_block_tokens(sequences: list[list[int]], block_size: int) -> int:
    """Tokens the tree holds: edges start on block boundaries, so each distinct block of tokens
    after a distinct prefix is held once, a partial one only when no held block extends it."""
    B = block_size
    chunks = {(tuple(s[:i]), tuple(s[i : i + B])) for s in sequences for i in range(0, len(s), B)}
    return sum(
        len(c)
        for p, c in chunks
        if not any(q == p and len(d) > len(c) and d[: len(c)] == c for q, d in chunks)
    )


def test_snapshot_token_counts_match_a_naive_model_and_leak_no_token_ids():
    rng = random.Random(7)
    cache = RadixCache(BlockPool(4096, 4))
    base = [rng.randrange(1000, 2000) for _ in range(12)]
    for _ in range(60):
        seq = base[: rng.randrange(0, 12)] + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 9))]
        put(cache, seq)
        if rng.random() < 0.2:
            cache.evict(rng.randrange(1, 4))
            cache.check_invariants()
        snap = tree_snapshot(cache)
        root = snap["nodes"][0]
        assert root["subtree_tokens"] == distinct_block_tokens(cache.cached_sequences(), 4)
        assert sum(n["tokens"] for n in snap["nodes"]) == root["subtree_tokens"]
    numbers = []  # every number in the JSON: counts and sizes stay far below the token ids' range
    json.loads(json.dumps(tree_snapshot(cache)), parse_int=lambda s: numbers.append(int(s)) or 0)
    assert numbers and not any(1000 <= n < 2000 for n in numbers)


def test_snapshot_is_bounded_and_sums_the_rest_into_other():
    cache = RadixCache(BlockPool(4096, 2))
    for i in range(300):
        put(cache, [7, 7, 100 + i, 5, 6])
    snap = tree_snapshot(cache, max_nodes=50)
    kept = [n for n in snap["nodes"] if n["tier"] != "other"]
    assert len(kept) == 50
    assert snap["nodes"][0]["subtree_tokens"] == 2 + 300 * 3
    assert sum(n["tokens"] for n in snap["nodes"]) == 2 + 300 * 3
    assert sum(n.get("other", 0) for n in snap["nodes"]) == 300 - 48


def test_namespace_filter_keeps_only_the_callers_namespace():
    cache = RadixCache(BlockPool(4096, 4))
    a, b = salt_offset("key:a"), salt_offset("key:b")
    put(cache, salted(list(range(1, 17)), a))
    put(cache, salted(list(range(1, 9)), b))
    only_b = tree_snapshot(cache, [b])
    assert only_b["nodes"][0]["subtree_tokens"] == 8
    assert list(only_b["namespaces"].values()) == [2]
    assert tree_snapshot(cache)["nodes"][0]["subtree_tokens"] == 24


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [True, False])
def test_engine_dashboard_shows_a_shared_prefix_as_one_node(engine_process):
    """Over the core process and in-process alike: three prompts sharing 40 tokens leave one node
    of the shared whole blocks (edges start on block boundaries), under which each prompt's rest."""
    from radixkv import AsyncEngine, EngineConfig, SamplingParams

    async def run() -> dict:
        config = EngineConfig(model="tiny-llama", kv_cache_memory="16MiB")
        engine = AsyncEngine(config, engine_process=engine_process)
        try:
            shared = list(range(5, 45))
            prompts = [shared + [100 + i, 7, 8] for i in range(3)]
            await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=2)) for p in prompts))
            return engine.dashboard(None)
        finally:
            await engine.shutdown()

    view = asyncio.run(run())
    B = view["block_size"]
    nodes = view["tree"]["nodes"]
    top = [n for n in nodes if n["parent"] == nodes[0]["id"]]
    assert [n["tokens"] for n in top] == [40 // B * B]
    assert sum(n["blocks"] for n in nodes) == view["blocks"]["device"]["cached"]
