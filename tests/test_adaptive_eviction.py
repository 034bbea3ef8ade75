"""The `adaptive` policy (W-TinyLFU whose setting miniature simulations choose), its
miniature caches and its frequency sketch.

Oracles: a plain `Counter` for the sketch (a count-min never underestimates, and halves on
aging); naive LRU and GDSF caches (a list, a scan) for the miniatures, and the full-size cache's
hit rate for a sampled one; LRU and GDSF themselves for the controller; LRU itself for the
policy with its window at the whole cache (it must then be LRU exactly); the offline optimum
as a bound; transformers' greedy outputs in the engine. The random cache harness with
`check_invariants()` after every step lives in `test_kv_cache_random.py`.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from shared_traces import random_hash_trace, shared_trace

from radixkv import Engine, SamplingParams
from radixkv.cache import BlockPool, KVCacheManager, RadixCache, miniature
from radixkv.cache.eviction import GDSF, LRU, Adaptive
from radixkv.cache.frequency_sketch import MAX_COUNT, FrequencySketch
from radixkv.cache.miniature import SETTINGS
from radixkv.cache.offline_optimal import OfflineOptimal
from radixkv.cli import main
from radixkv.tools.simulate import CacheRequest, hit_tokens, requests_from_workload, serve
from radixkv.workloads.format import Workload
from radixkv.workloads.generate import DocsParams, OneUseParams, generate_docs, generate_one_use
from radixkv.workloads.traces import HashIdTokens

MOONCAKE = shared_trace("mooncake_synthetic_trace.jsonl")
CLAUDE = shared_trace("claude_code_sessions36.jsonl.gz")


def hits(requests: list[CacheRequest], capacity: int, policy, block_size: int = 16) -> int:
    pool = BlockPool(capacity, block_size)
    return serve(KVCacheManager(pool, RadixCache(pool, policy)), requests).tokens


# ------------------------------------------------------------------ sketch


def test_the_sketch_never_underestimates_and_halves_when_it_ages():
    rng = random.Random(0)
    sketch = FrequencySketch(64, period=10**9)
    truth = Counter()
    for _ in range(3000):
        key = rng.getrandbits(64) if rng.random() < 0.5 else rng.randrange(20)
        sketch.add(key)
        truth[key] += 1
    for key, count in truth.items():
        assert sketch.estimate(key) >= min(count, MAX_COUNT)
    hot = [k for k in range(20) if truth[k] >= MAX_COUNT]
    assert hot and all(sketch.estimate(k) == MAX_COUNT for k in hot)
    before = {k: sketch.estimate(k) for k in range(20)}
    sketch.age()
    assert all(sketch.estimate(k) == before[k] // 2 for k in range(20))
    assert sketch.nbytes == 4 * 64


def test_the_sketch_ages_by_itself_after_its_period():
    sketch = FrequencySketch(16, period=8)
    for _ in range(7):
        sketch.add(42)
    assert sketch.estimate(42) == 7
    sketch.add(42)  # the eighth sighting: every counter is halved
    assert sketch.estimate(42) == 4 and sketch.additions == 0


def test_the_sketch_memory_is_four_bytes_a_block_rounded_up():
    policy = Adaptive()
    policy.sized(1000, 16)
    assert policy.sketch.nbytes == 4 * 1024


# ------------------------------------------------------------------ policy


@pytest.mark.parametrize("seed", range(4))
def test_with_the_window_at_the_whole_cache_it_is_lru_exactly(seed):
    rng = random.Random(seed)
    tokens = HashIdTokens(4)
    trace = random_hash_trace(rng, 300, extend_p=0.8, max_new=5)
    requests = [CacheRequest(0.0, tokens.tokens(ids), []) for ids in trace]
    capacity = rng.randint(max(map(len, trace)) + 1, 60)
    fixed = Adaptive(window=1.0, adapt=False)
    assert hits(requests, capacity, fixed, 4) == hits(requests, capacity, LRU(), 4)


def test_a_small_window_turns_one_off_prompts_away_and_keeps_a_reused_prefix():
    """A prefix used three times outlives a stream of one-off prompts that LRU lets flush it."""
    block = 4
    hot = list(range(1000, 1016))  # four blocks
    requests = [CacheRequest(0.0, hot + [1 + k], []) for k in range(3)]
    requests += [CacheRequest(0.0, [5000 + 100 * k + j for j in range(16)], []) for k in range(6)]
    requests.append(CacheRequest(0.0, hot + [9], []))
    lru = hits(requests, 12, LRU(), block)
    tiny = hits(requests, 12, Adaptive(window=0.0, adapt=False), block)
    assert (lru, tiny) == (2 * 16, 3 * 16)


def zipf_stream(rng: random.Random, n: int, keys: int, depth: int = 64) -> list[tuple[int, int]]:
    """(position, key) accesses, keys Zipf-popular, each key at a fixed block depth."""
    weights = [1.0 / (k + 1) for k in range(keys)]
    picks = rng.choices(range(keys), weights, k=n)
    return [(16 * (k % depth), k) for k in picks]


class NaiveLRU:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.order = capacity, []

    def access(self, key: int, position: int) -> bool:
        hit = key in self.order
        if hit:
            self.order.remove(key)
        self.order.append(key)
        del self.order[: max(0, len(self.order) - self.capacity)]
        return hit


class NaiveGDSF:
    """GDSF by a scan for the least (priority, last access) at every eviction."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.inflation, self.clock = capacity, 0.0, 0
        self.entries: dict[int, list] = {}  # key -> [priority, last access, hits]

    def access(self, key: int, position: int) -> bool:
        self.clock += 1
        entry = self.entries.get(key)
        hits = 0 if entry is None else entry[2] + 1
        cost = 1.0 + position / miniature.ATTENTION_TOKENS
        self.entries[key] = [self.inflation + (hits + 1) * cost, self.clock, hits]
        if entry is None and len(self.entries) > self.capacity:
            victim = min(self.entries, key=lambda k: self.entries[k][:2])
            self.inflation = max(self.inflation, self.entries.pop(victim)[0])
        return entry is not None


@pytest.mark.parametrize("seed", range(3))
def test_the_miniature_lru_and_gdsf_hit_exactly_as_naive_ones(seed):
    rng = random.Random(seed)
    stream = zipf_stream(rng, 4000, 300)
    for fast, naive in ((miniature.MiniLRU(50), NaiveLRU(50)), (miniature.MiniGDSF(50), NaiveGDSF(50))):
        assert [fast.run([(p, k)]) == 1 for p, k in stream] == [naive.access(k, p) for p, k in stream]
        assert len(fast) == 50


def test_the_miniature_tinylfu_keeps_a_hot_key_through_a_scan_that_flushes_lru():
    counts = miniature.Counts(10**6)
    tiny, lru = miniature.MiniTinyLFU(20, 0.05, counts), miniature.MiniLRU(20)
    for _ in range(5):  # the miniature counts what it runs
        tiny.run([(0, 7)]), lru.run([(0, 7)])
    assert counts.get(7) == 5
    for key in range(100, 160):  # a scan of keys seen once
        tiny.run([(0, key)]), lru.run([(0, key)])
        assert len(tiny) <= 20
    assert tiny.run([(0, 7)]) == 1 and lru.run([(0, 7)]) == 0


def test_the_counts_halve_and_stay_within_their_bound():
    counts = miniature.Counts(period=100)
    rng = random.Random(0)
    for _ in range(10_000):
        counts.add(rng.randrange(10**9) if rng.random() < 0.7 else rng.randrange(5))
        assert len(counts.counts) <= 150
    assert counts.get(0) >= 1 and counts.get(10**10) == 0


@pytest.mark.parametrize("num_blocks", [1000, 4000, 16000])
def test_a_miniature_over_sampled_depths_estimates_the_full_lrus_hit_rate(num_blocks):
    """Spatial sampling's promise: a cache of rate x capacity fed only the blocks at sampled
    depths hits about as often, per access, as the full cache fed every block. The stream is
    prompts over Zipf-popular documents of 8 to 120 blocks, a block's key its document and
    depth."""
    rng = random.Random(num_blocks)
    documents = num_blocks // 8
    weights = [1.0 / (d + 1) for d in range(documents)]
    lengths = [rng.randint(8, 120) for _ in range(documents)]
    stream = [
        (16 * depth, doc * 1000 + depth)
        for doc in rng.choices(range(documents), weights, k=3000)
        for depth in range(lengths[doc])
    ]
    full = miniature.MiniLRU(num_blocks)
    true_rate = full.run(stream) / len(stream)
    minis = miniature.Miniatures(num_blocks, 16, settings=(miniature.LRU_SETTING,))
    sampled = set(minis._depths_between(0, 120))
    seen = [(p, k) for p, k in stream if p // 16 in sampled]
    assert 0.5 * minis.rate * len(stream) < len(seen) < 2 * minis.rate * len(stream)
    mini_rate = minis.caches[0].run(seen) / len(seen)
    assert 0.2 < true_rate < 0.95 and abs(mini_rate - true_rate) < 0.04, (mini_rate, true_rate)


def test_the_miniatures_hold_at_most_35_keys_per_16_blocks_of_the_pool():
    small, large = miniature.Miniatures(4000, 16), miniature.Miniatures(1_000_000, 16)
    # four miniatures (GDSF's heap beside its entries) and 1.5 count periods for each W-TinyLFU
    assert small.max_entries == 5 * 250 + 2 * 15 * 250 and large.max_entries == 35 * 62_500
    assert miniature.Miniatures(100, 16).max_entries == 35 * 64
    rng = random.Random(1)
    for _ in range(200):
        large.access([(16 * rng.randrange(10**5), rng.getrandbits(64)) for _ in range(50)], False)
    assert all(len(c) <= large.capacity for c in large.caches)
    tiny = [c for c in large.caches if isinstance(c, miniature.MiniTinyLFU)]
    assert len(tiny) == 2 and all(len(c.counts.counts) <= 1.5 * c.counts.period for c in tiny)
    assert all(c.held <= c.max_entries for c in large.caches)


def test_queued_accesses_hit_as_a_feed_request_by_request():
    """The miniatures run their queue in batches: each one's hits over a period equal those of
    a twin fed every request's blocks as they come (a stream that reuses keys, so every
    miniature both hits and evicts)."""
    minis = miniature.Miniatures(2000, 16)
    twins = miniature.Miniatures(2000, 16).caches  # the same settings, fed directly
    rng = random.Random(3)
    keys = [rng.getrandbits(64) for _ in range(600)]  # more than a miniature holds
    expected = [0] * len(twins)
    for step in range(1, 400):
        blocks = [(16 * rng.randrange(200), rng.choice(keys)) for _ in range(rng.randrange(1, 9))]
        minis.access(blocks, False)
        expected = [e + t.run(blocks) for e, t in zip(expected, twins, strict=True)]
        if step % 97 == 0:
            scores = [miniature.DECAY * s for s in minis.scores]
            minis.decide(0, 0.0)
            assert minis.scores == [s + e for s, e in zip(scores, expected, strict=True)]
            assert min(expected) > 0
            expected = [0] * len(twins)


def one_use(**changes) -> list[CacheRequest]:
    params = OneUseParams(**{"sessions": 300, "prefixes": 20, "seed": 0, **changes})
    return requests_from_workload(Workload(generate_one_use(params), {}), tokenizer=None)


class FixedShare:
    """A miniature stand-in that hits a fixed share of the blocks it runs."""

    def __init__(self, share: float) -> None:
        self.share = share

    def run(self, blocks) -> int:
        return round(self.share * len(blocks))


def run_controller(shares, live_share, periods: int) -> list[int]:
    """The settings a controller runs, period by period, over miniatures that hit `shares(p)`
    of period p's sampled blocks while the live cache under setting i hits `live_share(i)`."""
    minis = miniature.Miniatures(1600, 16)
    minis.caches = [FixedShare(0.0) for _ in minis.settings]
    current, ran = 0, []
    for period in range(periods):
        for cache, share in zip(minis.caches, shares(period), strict=True):
            cache.share = share
        ran.append(current)
        blocks = [(16 * d, d) for d in range(minis.capacity)]
        found = round(live_share(current) * len(blocks))
        minis.access(blocks[:found], True)
        minis.access(blocks[found:], False)
        current = minis.decide(current, Adaptive.MARGIN)
    return ran


def test_the_controller_moves_to_the_leading_miniature_without_trying_the_others():
    """GDSF's miniature leads and each live setting hits as its miniature does: the start is
    measured (three periods), then GDSF runs, and the settings that trail are never run."""
    shares = [0.2, 0.3, 0.25, 0.5]
    ran = run_controller(lambda _: shares, lambda i: shares[i], 12)
    assert ran == [0, 0, 0] + [3] * 9


def test_a_setting_run_for_the_first_time_is_kept_until_it_is_measured():
    """LRU's miniature takes the lead right after the move to GDSF: GDSF still runs its three
    periods, then LRU runs."""
    before, after = [0.2, 0.3, 0.25, 0.5], [0.2, 0.3, 0.6, 0.5]
    ran = run_controller(lambda p: before if p < 3 else after, lambda i: after[i], 12)
    assert ran == [0, 0, 0, 3, 3, 3] + [2] * 6


def test_a_setting_the_live_cache_falls_short_of_is_discounted():
    """Live GDSF hits 0.3 where its miniature hits 0.5: once measured, its score is cut by the
    most `CALIBRATION` allows (to 0.425), LRU's 0.45 leads, and LRU is kept."""
    shares = [0.2, 0.3, 0.45, 0.5]
    ran = run_controller(lambda _: shares, lambda i: 0.3 if i == 3 else shares[i], 15)
    assert ran == [0, 0, 0, 3, 3, 3] + [2] * 9
    assert miniature.CALIBRATION[0] * 0.5 < 0.45


def test_the_controller_runs_the_best_setting_and_does_not_flap():
    requests = one_use()
    policy = Adaptive()
    got = hits(requests, 1000, policy)
    best = max(hits(requests, 1000, LRU()), hits(requests, 1000, GDSF()))
    assert got >= 0.99 * best
    assert policy.trajectory[-1][0] > 0 and len(policy.trajectory) <= 6, "it flapped"


def test_a_switch_to_gdsf_and_back_rekeys_every_leaf_and_keeps_the_books():
    """Every setting in turn, GDSF included, a switch every 5 requests, under the tree's own
    invariant checks after every request."""
    requests = one_use(sessions=60, prefix_tokens=(32, 128), user_tokens=(16, 64))
    policy = Adaptive(adapt=False)
    pool = BlockPool(60, 16)
    kv = KVCacheManager(pool, RadixCache(pool, policy))
    switches = len(requests) // 5
    cycle = [SETTINGS[i % len(SETTINGS)].name for i in range(1 + switches)]
    for i, request in enumerate(requests):
        if i % 5 == 4:
            policy.pending = SETTINGS[(i // 5 + 1) % len(SETTINGS)]
        serve(kv, [request])
        kv.cache.check_invariants()
    assert [s for _, s in policy.trajectory] == cycle, "a switch was skipped or misapplied"


def test_adaptive_never_beats_the_offline_optimum():
    for seed in range(3):
        rng = random.Random(seed)
        tokens = HashIdTokens(4)
        trace = random_hash_trace(rng, 200, extend_p=0.8, max_new=5)
        requests = [CacheRequest(0.0, tokens.tokens(ids), []) for ids in trace]
        capacity = rng.randint(max(map(len, trace)) + 1, 60)
        best = hit_tokens(requests, capacity, 4, OfflineOptimal.name)
        assert hits(requests, capacity, Adaptive(), 4) <= best


# ------------------------------------------------------------- the claims


def one_off_docs(questions: int, seed: int) -> list[CacheRequest]:
    """Docs questions of which 60% bring a document of their own: most blocks are used once."""
    p = DocsParams(questions=questions, one_off=0.6, repeat=0.1, seed=seed)
    return requests_from_workload(Workload(generate_docs(p), {}), tokenizer=None)


def test_on_one_off_documents_adaptive_beats_lru_by_a_third():
    """1,200 blocks hold the shared documents and preambles (927 blocks) beside the largest
    request (about 260)."""
    requests = one_off_docs(400, seed=0)
    lru, adaptive = hits(requests, 1200, LRU()), hits(requests, 1200, Adaptive())
    assert adaptive >= 1.3 * lru, (adaptive, lru)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12])
def test_where_most_blocks_pass_once_adaptive_keeps_1_3x_lru_and_0_4x_the_optimum(seed):
    """A long conversation trace of which about 78% of blocks are used once (the shape of
    docs/adaptive-eviction.md's 78% row, a quarter of its traffic over a quarter of its pool):
    the bound a user turns the policy on for."""
    params = OneUseParams(
        sessions=2500,
        returns=0.2,
        prefixes=125,
        popularity=0.7,
        prefix_tokens=(256, 1024),
        user_tokens=(256, 1536),
        gap_requests=115,
        seed=seed,
    )
    requests = requests_from_workload(Workload(generate_one_use(params), {}), tokenizer=None)
    optimum = hit_tokens(requests, 1000, 16, OfflineOptimal.name)
    lru, gdsf, adaptive = (hits(requests, 1000, p) for p in (LRU(), GDSF(), Adaptive()))
    assert adaptive >= 1.3 * lru and adaptive >= 0.99 * gdsf, (adaptive, lru, gdsf)
    assert adaptive >= 0.4 * optimum, (adaptive, optimum)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_on_one_off_documents_of_other_seeds_adaptive_beats_lru_by_a_third(seed):
    requests = one_off_docs(2000, seed)
    lru, adaptive = hits(requests, 1200, LRU()), hits(requests, 1200, Adaptive())
    assert adaptive >= 1.3 * lru, (adaptive, lru)


@pytest.mark.slow
@pytest.mark.parametrize("trace", [MOONCAKE, CLAUDE], ids=["mooncake", "claude-code"])
def test_on_the_shared_traces_adaptive_keeps_lrus_hit_rate_at_every_capacity(trace, capsys):
    if not trace.exists():
        pytest.skip(f"{trace.name} is not present")
    args = ["simulate", str(trace), "--hash-block", "16", "--capacity-blocks", "1000,4000,16000"]
    assert main([*args, "--eviction", "lru,adaptive", "--json"]) == 0
    rate = {(r["capacity_blocks"], r["eviction"]): r["hit_rate"] for r in json.loads(capsys.readouterr().out)}
    for capacity in (1000, 4000, 16000):
        assert rate[capacity, "adaptive"] >= 0.99 * rate[capacity, "lru"], capacity


# ------------------------------------------------------------------ engine


@pytest.mark.parametrize("host_kib", [0, pytest.param(128, marks=pytest.mark.slow)])
def test_engine_outputs_under_memory_pressure_equal_transformers(model_folders, reference_models, host_kib):
    """48 blocks of 4 tokens: a shared preamble and one-off prompts keep the pool evicting (to the
    host tier, with one); every greedy output equals transformers'."""
    from test_engine import transformers_greedy

    engine = Engine.from_pretrained(
        model_folders["llama"],
        block_size=4,
        kv_cache_memory="96KiB",
        host_kv_cache_memory=f"{host_kib}KiB",
        eviction="adaptive",
    )
    engine.step_hooks.append(Engine.check_invariants)
    rng = random.Random(7)
    preamble = [rng.randrange(256) for _ in range(24)]
    prompts = []
    for k in range(6):
        tail = [rng.randrange(256) for _ in range(rng.randrange(20, 60))]
        prompts.append(preamble + tail if k % 2 else tail)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts[:3], params) + engine.generate(prompts[3:], params)
    assert engine.metrics()["num_evicted_blocks"] > 0, "the pool never evicted"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == transformers_greedy(reference_models["llama"], prompt, 6)
    engine.kv.check_invariants([])
    assert engine.kv.pool.num_free + engine.kv.cache.evictable_size == engine.kv.pool.num_blocks


def test_simulate_writes_the_settings_chosen(tmp_path, capsys):
    rng = random.Random(5)
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": i, "input_length": 4 * len(ids), "output_length": 1, "hash_ids": ids}
        for i, ids in enumerate(random_hash_trace(rng, 120))
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "window.jsonl"
    args = ["simulate", str(trace), "--hash-block", "4", "--block-size", "4", "--capacity-blocks", "30,60"]
    assert main([*args, "--eviction", "lru,adaptive", "--trajectory", str(out), "--json"]) == 0
    assert [r["eviction"] for r in json.loads(capsys.readouterr().out)] == ["lru", "adaptive"] * 2
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["capacity_blocks"] for line in lines] == [30, 60]
    names = {s.name for s in SETTINGS}
    assert lines[0]["settings"][0] == [0, "window 0.01"]
    assert all(name in names for _, name in lines[0]["settings"])
