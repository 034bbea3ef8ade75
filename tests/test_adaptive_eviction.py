"""The `adaptive` policy (W-TinyLFU with a hill-climbed window) and its frequency sketch.

Oracles: a plain `Counter` for the sketch (a count-min never underestimates, and halves on
aging); LRU itself for the policy with its window at the whole cache (it must then be LRU
exactly); the offline optimum as a bound; transformers' greedy outputs in the engine. The random
cache harness with `check_invariants()` after every step lives in `test_kv_cache_random.py`.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from shared_traces import random_hash_trace, shared_trace

from radixkv import Engine, SamplingParams
from radixkv.cache import BlockPool, KVCacheManager, RadixCache
from radixkv.cache.eviction import LRU, Adaptive
from radixkv.cache.frequency_sketch import MAX_COUNT, FrequencySketch
from radixkv.cache.offline_optimal import OfflineOptimal
from radixkv.cli import main
from radixkv.tools.simulate import CacheRequest, requests_from_workload, serve
from radixkv.workloads.format import Workload
from radixkv.workloads.generate import DocsParams, generate_docs
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


def test_the_window_moves_with_ghost_hits_and_its_trajectory_is_recorded():
    rng = random.Random(3)
    tokens = HashIdTokens(4)
    requests = [CacheRequest(0.0, tokens.tokens(ids), []) for ids in random_hash_trace(rng, 400)]
    policy = Adaptive()
    hits(requests, 40, policy, 4)
    shares = [s for _, s in policy.trajectory]
    seen = [b for b, _ in policy.trajectory]
    assert len(shares) > 20 and len(set(shares)) > 3, "the window never moved"
    assert seen == list(range(1, len(seen) + 1)) and all(0.0 <= s <= 1.0 for s in shares)


def test_adaptive_never_beats_the_offline_optimum():
    for seed in range(3):
        rng = random.Random(seed)
        tokens = HashIdTokens(4)
        trace = random_hash_trace(rng, 200, extend_p=0.8, max_new=5)
        requests = [CacheRequest(0.0, tokens.tokens(ids), []) for ids in trace]
        capacity = rng.randint(max(map(len, trace)) + 1, 60)
        pool = BlockPool(capacity, 4)
        oracle = OfflineOptimal([r.prompt for r in requests], 4)
        best = serve(KVCacheManager(pool, RadixCache(pool, oracle)), requests, oracle).tokens
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


def test_simulate_writes_the_window_trajectory(tmp_path, capsys):
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
    assert lines[0]["window_share"] and all(0 <= s <= 1 for _, s in lines[0]["window_share"])
