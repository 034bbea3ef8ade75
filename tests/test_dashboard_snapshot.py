"""The tree snapshot against a naive model: the cached sequences' distinct prefixes."""

import asyncio
import json
import random

import pytest

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.salt import salt_offset, salted
from radixkv.dashboard.snapshot import capture_tree, digest, namespace_of, tree_snapshot


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
    assert len(snap["nodes"]) == 50  # the root, the shared node, 47 branches and one `other`
    (other,) = [n for n in snap["nodes"] if n["tier"] == "other"]
    assert other["other"] == 300 - 47 and other["tokens"] == 3 and other["start"] == 2
    assert snap["nodes"][0]["subtree_tokens"] == 2 + 300 * 3
    assert sum(n["subtree_tokens"] if "other" in n else n["tokens"] for n in snap["nodes"]) == 2 + 300 * 3
    assert sum(n["blocks"] for n in snap["nodes"]) == cache.evictable_size  # nothing lost
    assert snap["namespaces"] == {"unsalted": cache.evictable_size}  # counted over every node


def test_namespace_filter_keeps_only_the_callers_namespace():
    cache = RadixCache(BlockPool(4096, 4))
    a, b = salt_offset("key:a"), salt_offset("key:b")
    put(cache, salted(list(range(1, 17)), a))
    put(cache, salted(list(range(1, 9)), b))
    only_b = tree_snapshot(cache, [b])
    assert only_b["nodes"][0]["subtree_tokens"] == 8
    assert list(only_b["namespaces"].values()) == [2]
    assert tree_snapshot(cache)["nodes"][0]["subtree_tokens"] == 24


def naive_namespace_blocks(cache: RadixCache) -> dict[int, int]:
    """Device blocks per namespace, by a walk of every node (`namespace_of` its root child)."""
    out: dict[int, int] = {}
    for child in cache.root.children.values():
        ns = namespace_of(child.tokens[0])
        stack = [child]
        while stack:
            node = stack.pop()
            out[ns] = out.get(ns, 0) + len(node.blocks)
            stack.extend(node.children.values())
    return out


@pytest.mark.parametrize("seed", range(40))
def test_snapshot_bounds_hold_and_every_block_is_accounted_for(seed):
    """Random trees of several namespaces and sessions, random bounds: never more entries than
    `max_nodes` nor rows than `max_visit`; `sampled` exactly when the walk could not look at every
    node; the blocks shown (`other` entries included) and the unvisited ones add up to the cache's,
    and the namespace counts are a naive walk's whenever the walk saw everything."""
    rng = random.Random(seed)
    cache = RadixCache(BlockPool(8192, 4))
    salts = [None, "a", "b", "c"][: rng.randrange(1, 5)]
    for _ in range(rng.randrange(5, 120)):
        salt = rng.choice(salts)
        shared = [rng.randrange(1, 30) for _ in range(rng.choice([0, 4, 8]))]
        seq = shared + [rng.randrange(1, 3000) for _ in range(rng.randrange(1, 14))]
        put(cache, salted(seq, salt_offset(salt)))
    max_nodes, max_visit = rng.randrange(2, 80), rng.randrange(2, 300)
    total = sum(1 for _ in cache.nodes())
    device = cache.evictable_size + cache.protected_size
    snap = tree_snapshot(cache, max_nodes=max_nodes, max_visit=max_visit)
    nodes = snap["nodes"]
    assert len(nodes) <= max_nodes and snap["visited"] <= max_visit
    assert snap["sampled"] == (total > max_visit)
    seen = {n["id"] for n in nodes[:1]}
    for n in nodes[1:]:
        assert n["parent"] in seen  # one connected tree, parents first
        seen.add(n["id"])
    assert sum(n["blocks"] for n in nodes) + snap["unvisited_blocks"] == device
    naive = naive_namespace_blocks(cache)
    if not snap["sampled"]:
        hashed = {
            digest(ns.to_bytes(8, "little"), 4) if ns else "unsalted": b for ns, b in naive.items() if b
        }
        assert {k: v for k, v in snap["namespaces"].items() if v} == hashed
    salt = rng.choice(salts)
    mine = tree_snapshot(cache, [salt_offset(salt)], max_nodes=max_nodes, max_visit=max_visit)
    assert mine["visited"] <= max_visit
    if mine["sampled"]:
        assert mine["unvisited_blocks"] is None  # the filtered part's total is not known
    else:
        assert sum(n["blocks"] for n in mine["nodes"]) == naive.get(salt_offset(salt), 0)


def test_a_root_of_many_tenants_costs_the_walk_no_more_than_its_bound():
    """Another tenant's root children count against `max_visit` though they are passed over."""
    cache = RadixCache(BlockPool(8192, 4))
    for i in range(1000):
        tokens = salted([1 + i % 50, 2, 3, 4, 5], salt_offset(f"tenant-{i}"))
        blocks = cache.pool.allocate(2)
        cache.insert(tokens, blocks)
        for b in blocks:
            cache.pool.decref(b)
    put(cache, salted([9, 9, 9, 9], salt_offset("me")))  # checks the invariants once
    snap = tree_snapshot(cache, [salt_offset("me")], max_visit=100)
    assert snap["visited"] <= 100 and snap["sampled"]
    captured = capture_tree(cache, [salt_offset("me")], max_visit=100)
    assert len(captured["rows"]) <= 100


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
