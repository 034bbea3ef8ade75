"""`simulate --store-blocks`: the KV store in the cache-only simulation, one cache or replicas."""

import json
import random

from radixkv.cache import BlockPool, KVCacheManager, RadixCache, make_policy
from radixkv.cli import main
from radixkv.tools.simulate import CacheRequest, SimulatedStore, serve
from radixkv.tools.simulate_replicas import simulate_replicas

B = 4


def requests(n: int, seed: int) -> list[CacheRequest]:
    """Chats over 4 system prompts of 10 blocks, 3 turns each, replies of fresh tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(10 * B)] for _ in range(4)]
    fresh = iter(range(-1, -(10**9), -1))
    out = []
    for s in range(n):
        prompt = systems[s % 4] + [rng.randrange(1000) for _ in range(rng.randrange(5, 15))]
        for _ in range(3):
            reply = [next(fresh) for _ in range(6)]
            out.append(CacheRequest(len(out), list(prompt), reply))
            prompt = prompt + reply + [rng.randrange(1000) for _ in range(rng.randrange(5, 15))]
    return out


def cache(capacity: int, store: SimulatedStore | None) -> KVCacheManager:
    pool = BlockPool(capacity, B)
    return KVCacheManager(pool, RadixCache(pool, make_policy("lru"), None, store and store.keyspace))


def test_a_restart_finds_every_full_block_the_last_run_cached():
    reqs = requests(12, seed=0)
    store = SimulatedStore(100_000, B)
    first = serve(cache(2000, store), reqs, None, store)
    second_cache = cache(2000, store)
    second = serve(second_cache, reqs, None, store)
    second_cache.check_invariants([])
    full = sum((len(r.prompt) - 1) // B * B for r in reqs)
    assert first.store_tokens == 0 and first.tokens < full
    assert full <= second.tokens <= sum(len(r.prompt) - 1 for r in reqs)
    assert second.store_tokens > 0


def test_a_small_store_keeps_its_size_and_finds_no_more_than_a_large_one():
    reqs = requests(12, seed=1)
    found = {}
    for size in (30, 100_000):
        store = SimulatedStore(size, B)
        serve(cache(2000, store), reqs, None, store)
        kv = cache(2000, store)
        found[size] = serve(kv, reqs, None, store).tokens
        kv.check_invariants([])
        assert len(store.backend.entries) <= size
    assert found[30] < found[100_000]


def test_round_robin_over_a_shared_store_keeps_what_cache_aware_routing_keeps():
    reqs = requests(40, seed=2)
    aware = simulate_replicas(reqs, 2, ["cache-aware"], [40], B, ["lru"])[0]
    shared = simulate_replicas(reqs, 2, ["round-robin"], [40], B, ["lru"], store_blocks=100_000)[0]
    alone = simulate_replicas(reqs, 2, ["round-robin"], [40], B, ["lru"])[0]
    # The store holds whole blocks only; a cache on the device also matches inside a block.
    assert alone.hit_rate < 0.97 * aware.hit_rate <= shared.hit_rate
    assert shared.store_hit_tokens > 0 and shared.store_blocks == 100_000


def test_the_command_line_reports_the_store(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": i, "input_length": 64, "output_length": 4, "hash_ids": [0, 1, 2, i + 3]}
        for i in range(6)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    args = [str(trace), "--hash-block", "16", "--block-size", "16", "--capacity-blocks", "4", "--json"]
    assert main(["simulate", *args, "--store-blocks", "100"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["store_blocks"] == 100 and row["store_hit_tokens"] >= 0 and row["hit_rate"] > 0
