"""`simulate --replicas`: hit rates and request counts against an independent model of N LRU
caches behind the same routing rules, and the Mooncake targets of the router."""

import json
import random
from collections import OrderedDict, deque
from pathlib import Path

import pytest

from radixkv.cli import main
from radixkv.router import RouterConfig
from radixkv.tools.simulate import CacheRequest
from radixkv.tools.simulate_replicas import IN_FLIGHT_PER_REPLICA, simulate_replicas
from radixkv.workloads.traces import HashIdTokens

# The shared traces sit beside the repository, or beside the folder of its worktrees.
TRACE = "shared/traces/mooncake_synthetic_trace.jsonl"
MOONCAKE = next((p for up in Path(__file__).parents[2:4] if (p := up / TRACE).exists()), Path(TRACE))


class NaiveLRU:
    """Block-level LRU over hash ids (each id names its whole prefix): a request hits its leading
    run of cached ids, less the last token, which the engine always recomputes; then all its ids
    are touched, deepest first, so a prefix outlives its extensions."""

    def __init__(self, capacity: int, hash_block: int) -> None:
        self.capacity, self.hash_block = capacity, hash_block
        self.ids: OrderedDict[int, None] = OrderedDict()

    def leading(self, ids: list[int]) -> int:
        k = 0
        while k < len(ids) and ids[k] in self.ids:
            k += 1
        return k

    def serve(self, ids: list[int]) -> int:
        k = self.leading(ids)
        for i in reversed(ids):
            self.ids[i] = None
            self.ids.move_to_end(i)
        while len(self.ids) > self.capacity:
            self.ids.popitem(last=False)
        return k * self.hash_block - (k == len(ids))


def naive_replicas(trace, replicas, router, capacity, hash_block):
    """(hit tokens, requests per replica): the routing rules as the README states them, over
    naive LRU caches for the replicas and naive LRU estimates for the router."""
    config = RouterConfig()
    share, gap, ratio = config.min_match_share, config.balance_abs, config.balance_rel
    caches = [NaiveLRU(capacity, hash_block) for _ in range(replicas)]
    estimates = [NaiveLRU(capacity, hash_block) for _ in range(replicas)]
    load, counts, in_flight, hits = [0] * replicas, [0] * replicas, deque(), 0
    for turn, ids in enumerate(trace):
        matched = [e.leading(ids) * hash_block for e in estimates]
        if router == "round-robin":
            r = turn % replicas
        else:
            candidates = list(range(replicas))
            skewed = max(load) - min(load) > gap and max(load) > min(load) * ratio
            best = max(matched)
            if router == "cache-aware" and not skewed and best and best >= share * len(ids) * hash_block:
                candidates = [i for i in candidates if matched[i] == best]
            low = min(load[i] for i in candidates)
            tied = [i for i in candidates if load[i] == low]
            r = tied[turn % len(tied)]
        hits += caches[r].serve(ids)
        estimates[r].serve(ids)
        load[r] += 1
        counts[r] += 1
        in_flight.append((r, ids))
        if len(in_flight) > IN_FLIGHT_PER_REPLICA * replicas:
            done, done_ids = in_flight.popleft()
            load[done] -= 1
            estimates[done].serve(done_ids)
    return hits, counts


def session_trace(rng: random.Random, n: int) -> list[list[int]]:
    """Chat-like hash-id requests: a few shared system prefixes, conversations that grow turn by
    turn, and some one-off prompts."""
    systems = [[s * 1000 + k for k in range(rng.randint(1, 4))] for s in range(3)]
    chats: list[list[int]] = []
    fresh = iter(range(100_000, 10**9))
    trace = []
    for _ in range(n):
        roll = rng.random()
        if chats and roll < 0.6:
            c = rng.randrange(len(chats))
            chats[c] = chats[c] + [next(fresh) for _ in range(rng.randint(1, 3))]
            trace.append(chats[c])
        elif roll < 0.85:
            chats.append(rng.choice(systems) + [next(fresh) for _ in range(rng.randint(1, 3))])
            trace.append(chats[-1])
        else:
            trace.append([next(fresh) for _ in range(rng.randint(1, 6))])
    return trace


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("router", ["cache-aware", "round-robin", "least-load"])
def test_replica_hits_and_counts_equal_an_independent_model(seed, router):
    rng = random.Random(seed)
    trace = session_trace(rng, 250)
    hash_block = rng.choice([1, 4])
    replicas = rng.choice([2, 3])
    capacity = rng.randint(max(map(len, trace)), 80)
    tokens = HashIdTokens(hash_block)
    requests = [CacheRequest(float(i), tokens.tokens(ids), []) for i, ids in enumerate(trace)]
    (result,) = simulate_replicas(requests, replicas, [router], [capacity], hash_block, ["lru"])
    hits, counts = naive_replicas(trace, replicas, router, capacity, hash_block)
    assert (result.hit_tokens, result.requests_per_replica) == (hits, counts)
    assert result.imbalance == pytest.approx(max(counts) / (sum(counts) / replicas))


def test_cache_aware_routing_keeps_conversations_together():
    rng = random.Random(11)
    trace = session_trace(rng, 300)
    tokens = HashIdTokens(4)
    requests = [CacheRequest(float(i), tokens.tokens(ids), []) for i, ids in enumerate(trace)]
    rows = simulate_replicas(requests, 4, ["cache-aware", "round-robin"], [200], 4, ["lru"])
    aware, rr = rows
    single = simulate_replicas(requests, 1, ["round-robin"], [800], 4, ["lru"])[0]
    assert aware.hit_rate >= 0.9 * single.hit_rate
    assert aware.hit_rate > 1.25 * rr.hit_rate


@pytest.mark.slow
@pytest.mark.skipif(not MOONCAKE.exists(), reason="the shared Mooncake trace is not present")
def test_mooncake_cache_aware_matches_one_big_cache_with_even_load(capsys):
    args = [
        "simulate",
        str(MOONCAKE),
        "--hash-block",
        "16",
        "--block-size",
        "16",
        "--json",
    ]
    assert main([*args, "--capacity-blocks", "16000"]) == 0
    single = json.loads(capsys.readouterr().out)
    routers = ["--router", "cache-aware,round-robin"]
    assert main([*args, "--capacity-blocks", "4000", "--replicas", "4", *routers]) == 0
    aware, rr = json.loads(capsys.readouterr().out)
    assert (aware["router"], aware["replicas"], aware["capacity_blocks"]) == ("cache-aware", 4, 4000)
    assert aware["hit_rate"] >= 0.95 * single["hit_rate"]
    assert aware["hit_rate"] >= 2 * rr["hit_rate"]
    assert aware["imbalance"] <= 1.15


def test_unknown_router_is_refused_naming_the_choices(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    row = {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}
    trace.write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit):
        main(["simulate", str(trace), "--capacity-blocks", "8", "--replicas", "2", "--router", "random"])
    assert "cache-aware, round-robin, least-load" in capsys.readouterr().err
