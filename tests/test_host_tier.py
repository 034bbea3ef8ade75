"""The host tier in the cache and in `simulate`: evicted blocks are written back and hit again
from the host, full host pools evict by their own policy, and bad sizes are refused."""

import json
import random

import pytest
from shared_traces import shared_trace

from radixkv.cache import NO_DATA, BlockPool, KVCacheManager, RadixCache
from radixkv.cache.host_tier import HostTier, TransferKind, TransferQueue
from radixkv.cli import main
from radixkv.tools.simulate import CacheRequest, cache_hits
from radixkv.workloads.traces import HashIdTokens

MOONCAKE = shared_trace("mooncake_synthetic_trace.jsonl")


def two_tier(device: int, host: int, block_size: int = 4, write_through: bool = False) -> KVCacheManager:
    pool = BlockPool(device, block_size)
    tier = HostTier(host, block_size, write_through=write_through)
    return KVCacheManager(pool, RadixCache(pool, host=tier))


def serve(kv: KVCacheManager, tokens: list[int]) -> tuple[int, int]:
    """(tokens matched, of them loaded from the host) for one request served whole."""
    table = kv.admit(tokens)
    found = table.num_tokens, table.num_loaded_tokens
    kv.reserve([(table, len(tokens) - table.num_tokens)])
    kv.run_transfers(NO_DATA)
    kv.cache_finished(table, tokens)
    kv.check_invariants([])
    return found


def test_a_prompt_evicted_from_the_device_hits_again_from_the_host():
    kv = two_tier(device=4, host=8)
    a, b = list(range(100, 112)), list(range(200, 212))  # three blocks each
    serve(kv, a)
    serve(kv, b)  # the device holds 4 blocks: a's last two go to the host to make room
    assert kv.cache.host.num_offloaded == 2
    assert serve(kv, a + [1]) == (12, 8)  # a's first block from the device, the rest loaded
    assert kv.cache.host.num_loaded == 2


def test_loads_and_offloads_are_queued_in_order_and_batched_by_kind():
    q = TransferQueue()
    q.add(TransferKind.OFFLOAD, [1, 2], [10, 11])
    q.add(TransferKind.OFFLOAD, [3], [12])
    q.add(TransferKind.LOAD, [10], [1])  # reads what the offloads wrote: after them
    q.add(TransferKind.COPY, [1], [5])
    q.add(TransferKind.COPY, [5], [6])  # reads the last copy's destination: a new batch
    kinds = [(t.kind, t.src, t.dst) for t in q.pending]
    assert kinds == [
        (TransferKind.OFFLOAD, [1, 2, 3], [10, 11, 12]),
        (TransferKind.LOAD, [10], [1]),
        (TransferKind.COPY, [1], [5]),
        (TransferKind.COPY, [5], [6]),
    ]


def test_a_full_host_tier_evicts_by_its_policy_and_never_blocks_admission():
    kv = two_tier(device=3, host=3)
    prompts = [[k * 100 + j for j in range(8)] for k in range(6)]  # two blocks each
    for p in prompts:
        serve(kv, p)  # every one is admitted: a full host pool drops its least recent node
    host = kv.cache.host
    assert host.num_evicted > 0
    assert host.pool.num_free + len(kv.cache.referenced_host_blocks()) == 3
    assert kv.cache.cached_prefix_len(prompts[-1]) == 8  # the newest stays
    assert kv.cache.cached_prefix_len(prompts[0]) == 0  # the oldest is gone from both tiers


def test_write_through_copies_blocks_to_the_host_as_they_are_cached():
    kv = two_tier(device=8, host=8, write_through=True)
    serve(kv, list(range(8)))
    assert kv.cache.host.num_offloaded == 2
    assert len(kv.cache.referenced_host_blocks()) == 2
    kv.cache.evict(2)  # the device copies go; the host copies were written already
    assert kv.cache.host.num_offloaded == 2 and kv.cache.cached_prefix_len(list(range(8))) == 8


@pytest.mark.parametrize("seed", range(3))
def test_a_host_tier_only_adds_hits(seed):
    rng = random.Random(seed)
    tokens = HashIdTokens(4)
    trace, next_id = [], 0
    for _ in range(150):
        base = rng.choice(trace) if trace and rng.random() < 0.8 else []
        ids = base[: rng.randint(0, len(base))] + list(range(next_id, next_id + rng.randint(1, 5)))
        next_id += 5
        trace.append(ids)
    requests = [CacheRequest(0.0, tokens.tokens(ids), []) for ids in trace]
    one = cache_hits(requests, 30, 4, "lru")
    two = cache_hits(requests, 30, 4, "lru", host_blocks=60)
    infinite = cache_hits(requests, 10**5, 4, "lru")
    assert one.tokens < two.tokens <= infinite.tokens
    assert one.host_tokens == 0 < two.host_tokens <= two.tokens


def test_bad_host_sizes_are_clear_errors(capsys):
    with pytest.raises(ValueError, match="host_blocks"):
        HostTier(0, 16)
    with pytest.raises(ValueError, match="host eviction"):
        HostTier(8, 16, eviction="gdsf")
    with pytest.raises(ValueError, match="block size"):
        RadixCache(BlockPool(4, 16), host=HostTier(4, 8))
    with pytest.raises(SystemExit):
        main(["simulate", "x.jsonl", "--capacity-blocks", "4", "--host-blocks", "-3"])
    assert "positive number of blocks" in capsys.readouterr().err


def test_simulate_json_splits_hits_into_device_and_host(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": i, "input_length": 8, "output_length": 1, "hash_ids": [i % 4, 10 + i]}
        for i in range(12)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["simulate", str(trace), "--hash-block", "4", "--block-size", "4", "--capacity-blocks", "3"]
    assert main([*args, "--host-blocks", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_blocks"] == 16 and 0 < out["host_hit_tokens"] <= out["hit_tokens"]
    assert main([*args, "--json"]) == 0
    assert "host_blocks" not in json.loads(capsys.readouterr().out)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the shared Mooncake trace is not present")
def test_two_tiers_of_4000_and_16000_blocks_come_within_0_005_of_one_tier_of_20000(capsys):
    args = ["simulate", str(MOONCAKE), "--hash-block", "16", "--block-size", "16", "--json"]
    assert main([*args, "--capacity-blocks", "20000"]) == 0
    single = json.loads(capsys.readouterr().out)["hit_rate"]
    assert main([*args, "--capacity-blocks", "4000", "--host-blocks", "16000"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["hit_rate"] >= single - 0.005
    assert two["host_hit_tokens"] > 0.3 * two["hit_tokens"]
