"""Eviction policies beyond recency: GDSF, session-aware, and the offline optimum of simulate.

The offline optimum is checked against an independent block-level Belady over hash ids (a plain
dictionary, no tree); the online policies by the behaviour that sets them apart from LRU.
"""

import json
import random

import pytest
from shared_traces import random_hash_trace, shared_trace

from radixkv.cache import NO_DATA, BlockPool, KVCacheManager, RadixCache, make_policy
from radixkv.cli import main
from radixkv.tools.simulate import CacheRequest, hit_tokens, requests_from_workload
from radixkv.workloads.format import Session, Turn, Workload
from radixkv.workloads.traces import HashIdTokens

MOONCAKE = shared_trace("mooncake_synthetic_trace.jsonl")


def put(kv: KVCacheManager, tokens: list[int], session: str | None = None) -> None:
    """Serves `tokens` as one request would: admit, reserve the rest, cache, release."""
    table = kv.admit(tokens, session=session)
    kv.reserve([(table, len(tokens) - table.num_tokens)])
    kv.run_transfers(NO_DATA)
    kv.cache_finished(table, tokens)
    kv.check_invariants([])


def cached(kv: KVCacheManager, tokens: list[int]) -> int:
    return kv.cache.cached_prefix_len(tokens)


def manager(num_blocks: int, policy: str, block_size: int = 4) -> KVCacheManager:
    pool = BlockPool(num_blocks, block_size)
    return KVCacheManager(pool, RadixCache(pool, make_policy(policy)))


# ------------------------------------------------------------------ gdsf


def test_gdsf_keeps_a_hot_prefix_through_a_burst_of_one_off_prompts_where_lru_loses_it():
    hot = list(range(1000, 1008))  # two blocks, matched many times
    outcomes = {}
    for policy in ("lru", "gdsf"):
        kv = manager(6, policy)
        for _ in range(5):
            put(kv, hot + [1])
        for k in range(3):  # one-off prompts of two blocks each, more recent than the hot one
            put(kv, [5000 + 10 * k + j for j in range(8)])
        outcomes[policy] = cached(kv, hot)
    assert outcomes == {"lru": 0, "gdsf": 8}


def test_gdsf_ages_out_a_prefix_that_was_hot_long_ago():
    kv = manager(4, "gdsf")
    old = list(range(100, 108))
    for _ in range(3):
        put(kv, old + [1])
    for k in range(40):  # a new prefix, hit over and over, while the old one is never seen again
        put(kv, [7000 + k % 2 * 50 + j for j in range(8)] + [2])
    assert cached(kv, old) == 0
    kv.check_invariants([])


# ---------------------------------------------------------------- session


def test_session_policy_keeps_a_live_sessions_blocks_over_newer_one_off_blocks():
    for policy, survives in (("lru", False), ("session", True)):
        kv = manager(4, policy)
        chat = list(range(10, 18))
        put(kv, chat, session="chat")
        put(kv, list(range(30, 38)))  # one-off requests, newer than the chat's turn
        put(kv, list(range(50, 58)))
        assert (cached(kv, chat) == 8) is survives, policy


def test_a_closed_sessions_blocks_go_first_and_recency_orders_within_a_class():
    kv = manager(4, "session")
    put(kv, list(range(10, 18)), session="a")
    put(kv, list(range(20, 28)), session="b")
    kv.close_session("a")  # a is done: its blocks rank as a one-off request's
    put(kv, list(range(30, 38)))  # needs two blocks: the closed session's go, b's stay
    assert cached(kv, list(range(10, 18))) == 0
    assert cached(kv, list(range(20, 28))) == 8
    put(kv, list(range(40, 48)))  # now the one-off leaf (older) goes before the live session
    assert cached(kv, list(range(30, 38))) == 0
    assert cached(kv, list(range(20, 28))) == 8
    put(kv, list(range(60, 68)), session="c")  # only live sessions left: recency decides
    put(kv, list(range(70, 78)), session="d")
    assert cached(kv, list(range(20, 28))) == 0
    kv.check_invariants([])


def test_a_reopened_session_is_live_again():
    kv = manager(4, "session")
    put(kv, list(range(10, 18)), session="a")
    kv.close_session("a")
    put(kv, list(range(10, 18)) + [99], session="a")  # a later turn of the same session id
    put(kv, list(range(20, 28)))
    assert cached(kv, list(range(10, 18))) == 8


def test_workload_sessions_close_after_their_last_turn():
    s = Session("s", [Turn([1, 2, 3], 2), Turn([4], 2)])
    first, last = requests_from_workload(Workload([s], {}), tokenizer=None)
    assert (first.session, first.closes_session, last.closes_session) == ("s", False, True)


# ------------------------------------------------------------ offline optimum


def block_belady_hits(trace: list[list[int]], capacity: int, hash_block: int) -> int:
    """An independent block-level Belady over hash ids with the engine's working set: a request
    holds its matched prefix and the blocks it computes (or the copy of its last, partly
    matched block) while it runs, and evicts the cached block used again furthest ahead,
    deeper first among equals, never one of its own."""
    uses: dict[int, list[int]] = {}
    for i, ids in enumerate(trace):
        for h in ids:
            uses.setdefault(h, []).append(i)

    def next_use(h: int, now: int) -> float:
        later = [j for j in uses[h] if j > now]
        return later[0] if later else float("inf")

    cache: dict[int, int] = {}  # id -> depth in its chain
    hits = 0
    for i, ids in enumerate(trace):
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        whole = k == len(ids)
        hits += k * hash_block - whole
        need = 1 if whole else len(ids) - k  # the partly matched last block is copied
        need = min(need, capacity)
        held = set(ids[: k - whole])
        while len(cache) + need > capacity:
            victims = [h for h in cache if h not in held]
            if not victims:
                break
            worst = max(victims, key=lambda h: (next_use(h, i), cache[h]))
            del cache[worst]
        if len(cache) + need > capacity or len(ids) > capacity:
            continue  # the request does not fit: served, not cached
        for depth, h in enumerate(ids):
            cache[h] = depth
    return hits


@pytest.mark.parametrize("seed", range(5))
def test_optimal_equals_an_independent_block_level_belady_and_beats_every_online_policy(seed):
    rng = random.Random(seed)
    trace = random_hash_trace(rng, 200, extend_p=0.8, max_new=5)
    hash_block = 4
    capacity = rng.randint(max(map(len, trace)) + 1, 60)
    tokens = HashIdTokens(hash_block)
    requests = [CacheRequest(0.0, tokens.tokens(ids), []) for ids in trace]
    best = hit_tokens(requests, capacity, hash_block, "optimal")
    assert best == block_belady_hits(trace, capacity, hash_block)
    for policy in ("lru", "lfu", "gdsf", "session"):
        assert hit_tokens(requests, capacity, hash_block, policy) <= best, policy


def test_simulate_compares_several_policies_in_one_run(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": i, "input_length": 8, "output_length": 1, "hash_ids": [i % 3, 10 + i]} for i in range(9)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["simulate", str(trace), "--hash-block", "4", "--block-size", "4", "--capacity-blocks", "3,6"]
    assert main([*args, "--eviction", "lru,gdsf,optimal", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["capacity_blocks"], r["eviction"]) for r in out] == [
        (c, p) for c in (3, 6) for p in ("lru", "gdsf", "optimal")
    ]
    assert main([*args, "--eviction", "lru,optimal"]) == 0
    assert "of optimal" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--eviction", "lru,nope"])
    assert "nope" in capsys.readouterr().err


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the shared Mooncake trace is not present")
def test_gdsf_beats_lru_on_the_mooncake_trace(capsys):
    args = ["simulate", str(MOONCAKE), "--hash-block", "16", "--block-size", "16"]
    assert main([*args, "--capacity-blocks", "1000,4000", "--eviction", "lru,gdsf", "--json"]) == 0
    rate = {(r["capacity_blocks"], r["eviction"]): r["hit_rate"] for r in json.loads(capsys.readouterr().out)}
    for capacity in (1000, 4000):
        assert rate[capacity, "gdsf"] > rate[capacity, "lru"] + 0.005
