"""The KV store in the engine: a second engine over the same store (a restart, or another
replica) finds what the first computed, and its greedy outputs are transformers'; damaged
entries are recomputed, never used; a store that is down costs nothing but misses.

Tiny llama, block size 4 (2 KiB a block); `check_invariants` after every step.
"""

from __future__ import annotations

import random

import pytest
from redis_server import free_port, redis_url  # noqa: F401  (a fixture)
from test_engine import transformers_greedy

from radixkv import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(24)]  # a system prompt of 6 blocks
    return [shared + [rng.randrange(256) for _ in range(rng.randrange(10, 30))] for _ in range(n)]


def engine(model_folders, store: str, **kwargs) -> Engine:
    e = Engine.from_pretrained(
        model_folders["llama"], block_size=4, kv_cache_memory="256KiB", kv_store=store, **kwargs
    )
    e.step_hooks.append(Engine.check_invariants)
    return e


def full_blocks(prompt: list[int]) -> int:
    return (len(prompt) - 1) // 4 * 4


@pytest.mark.slow
def test_a_restarted_engine_finds_what_the_last_run_computed(model_folders, reference_models, tmp_path):
    batch = prompts(3, seed=1)
    url = f"file://{tmp_path}"
    with engine(model_folders, url) as first:
        cold = first.generate(batch, GREEDY)
        written = first.metrics()["kv_store_written_blocks"]
    assert written > 0  # close() flushed the queue
    with engine(model_folders, url) as second:
        warm = second.generate(batch, GREEDY)
    m = second.metrics()  # closed: every write done
    for prompt, a, b in zip(batch, cold, warm, strict=True):
        assert b.num_cached_tokens == full_blocks(prompt)
        assert a.token_ids == b.token_ids == transformers_greedy(reference_models["llama"], prompt, 6)
    assert m["store_cache_hits"] == sum(full_blocks(p) for p in batch) - 2 * 24  # the others hit memory
    assert m["kv_store_hit_blocks"] >= m["store_cache_hits"] // 4 and m["kv_store_read_bytes"] > 0
    # What was fetched is not written back; only the blocks the replies filled are written again.
    assert m["kv_store_written_blocks"] == sum((len(p) + 5) // 4 - (len(p) - 1) // 4 for p in batch)
    text = second.metrics_text()
    for name in ("store_cache_hits", "kv_store_hit_blocks", "kv_store_write_queue_blocks", "kv_store_errors"):
        assert f"radixkv_{name}" in text


@pytest.mark.slow
def test_damaged_entries_are_recomputed_never_used(model_folders, reference_models, tmp_path):
    batch = prompts(2, seed=2)
    url = f"file://{tmp_path}"
    with engine(model_folders, url) as first:
        first.generate(batch, GREEDY)
    files = sorted(p for p in tmp_path.rglob("*.kv"))
    assert len(files) >= 12
    rng = random.Random(0)
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 2:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)  # a flipped bit, anywhere
        else:
            data = data[: rng.randrange(len(data))]  # a truncated write
        path.write_bytes(bytes(data))
    with engine(model_folders, url) as second:
        outs = second.generate(batch, GREEDY)
        m = second.metrics()
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == transformers_greedy(reference_models["llama"], prompt, 6)
    assert m["store_cache_hits"] == 0 and m["kv_store_corrupt_entries"] >= 1


@pytest.mark.slow
def test_replicas_sharing_a_redis_store_find_each_others_blocks(
    model_folders,
    reference_models,
    redis_url,  # noqa: F811
):
    batch = prompts(2, seed=3)
    with engine(model_folders, redis_url) as a, engine(model_folders, redis_url) as b:
        a.generate(batch, GREEDY)
        assert a.store.flush(30)
        outs = b.generate(batch, GREEDY)
        assert b.metrics()["store_cache_hits"] == sum(full_blocks(p) for p in batch) - 24
    for prompt, out in zip(batch, outs, strict=True):
        assert out.num_cached_tokens == full_blocks(prompt)
        assert out.token_ids == transformers_greedy(reference_models["llama"], prompt, 6)


def test_a_store_that_is_down_is_only_misses(model_folders, reference_models):
    batch = prompts(2, seed=4)
    with engine(model_folders, f"redis://127.0.0.1:{free_port()}/0") as e:
        outs = e.generate(batch, GREEDY)
        m = e.metrics()
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == transformers_greedy(reference_models["llama"], prompt, 6)
    assert m["kv_store_errors"] >= 1 and m["store_cache_hits"] == 0


@pytest.mark.parametrize(
    "bad", [{"kv_store": "s3://x"}, {"kv_store": "file:///tmp/x", "enable_prefix_cache": False}]
)
def test_bad_store_configs_are_clear_errors(bad):
    from radixkv import EngineConfig

    with pytest.raises(ValueError, match="kv_store"):
        EngineConfig(device="cpu", **bad)


def test_a_failed_copy_off_the_device_loses_only_those_writes(
    model_folders, reference_models, tmp_path, monkeypatch
):
    from radixkv.model import runner

    def broken(kv_cache, blocks):
        raise RuntimeError("injected: device copy failed")

    monkeypatch.setattr(runner, "gather_blocks", broken)
    batch = prompts(2, seed=5)
    with engine(model_folders, f"file://{tmp_path}") as e:
        outs = e.generate(batch, GREEDY)
        again = e.generate(batch, GREEDY)  # the cache is intact: the device tier hits
    m = e.metrics()
    for prompt, out, hit in zip(batch, outs, again, strict=True):
        assert out.token_ids == hit.token_ids == transformers_greedy(reference_models["llama"], prompt, 6)
        assert hit.num_cached_tokens == len(prompt) - 1
    assert m["kv_store_dropped_writes"] > 0 and m["kv_store_errors"] >= 1
    assert m["kv_store_written_blocks"] == 0


@pytest.mark.slow
def test_a_salted_prompt_is_found_in_the_store_under_its_own_salt_only(
    model_folders, reference_models, tmp_path
):
    """The store is keyed as the cache keys blocks, salted: a restart finds tenant a's blocks
    for tenant a and for nobody else (another salt, or none), and every output is transformers'."""
    prompt = prompts(1, seed=6)[0]
    url = f"file://{tmp_path}"
    with engine(model_folders, url) as first:
        first.generate(prompt, GREEDY, cache_salt="tenant-a")
    expected = transformers_greedy(reference_models["llama"], prompt, 6)
    found = {}
    for salt in ("tenant-b", None, "tenant-a"):  # a fresh engine each: nothing in device memory
        with engine(model_folders, url) as e:
            (out,) = e.generate(prompt, GREEDY, cache_salt=salt)
            found[salt] = (e.metrics()["store_cache_hits"], out.num_cached_tokens)
        assert out.token_ids == expected
    assert found["tenant-b"] == found[None] == (0, 0)
    assert found["tenant-a"] == (full_blocks(prompt), full_blocks(prompt))


@pytest.mark.slow
def test_a_damaged_entry_mid_prompt_ends_the_stored_run_there(model_folders, reference_models, tmp_path):
    """Blocks before a damaged entry are fetched; the damaged one and every block after it are
    recomputed (a chain's later blocks are worth nothing without it)."""
    from radixkv.kvstore import FileBackend

    prompt = prompts(1, seed=7)[0]
    url = f"file://{tmp_path}"
    with engine(model_folders, url) as first:
        first.generate(prompt, GREEDY)
        keys = first.store.keyspace.block_keys(prompt, full_blocks(prompt) // 4)
    path = FileBackend(tmp_path).path(keys[3])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # a flipped bit in the payload's last byte
    path.write_bytes(bytes(data))
    with engine(model_folders, url) as second:
        (out,) = second.generate(prompt, GREEDY)
        m = second.metrics()
    assert out.token_ids == transformers_greedy(reference_models["llama"], prompt, 6)
    assert m["kv_store_corrupt_entries"] == 1
    assert m["store_cache_hits"] == out.num_cached_tokens == 3 * 4


def routed_hit_rate(
    engines: list[Engine], policy: str, sessions: list[list[list[int]]]
) -> tuple[float, list[list[int]]]:
    """Chat sessions (a system prompt, then user turns) through `engines` behind `policy`, one
    turn at a time, each session's turns round by round (so round robin sends a session's next
    turn to the other replica); a turn's blocks are in the store before the next turn is sent
    (the think time between turns is longer than a write). Returns the prompt tokens hit over
    all, and every reply."""
    from radixkv.router.router import Router

    router = Router(policy, len(engines), engines[0].metrics()["num_blocks"], 4)
    convs = [list(s[0]) for s in sessions]
    hit = total = 0
    replies = []
    for turn in range(1, len(sessions[0])):
        for i, s in enumerate(sessions):
            prompt = convs[i] + s[turn]
            decision = router.choose(prompt)
            router.dispatch(decision, prompt)
            e = engines[decision.replica]
            (out,) = e.generate(prompt, GREEDY, session_id=f"s{i}")
            assert e.store is None or e.store.flush(30)
            router.complete(decision.replica, prompt + out.token_ids)
            convs[i] = prompt + out.token_ids
            hit += out.num_cached_tokens
            total += len(prompt)
            replies.append(out.token_ids)
    return hit / total, replies


@pytest.mark.slow
def test_round_robin_over_a_shared_redis_store_hits_what_cache_aware_routing_hits(
    model_folders,
    redis_url,  # noqa: F811
):
    """The issue's bar in miniature, end to end with two engines and a real Redis: behind round
    robin each turn lands on the replica that did not serve the previous one, and the store
    gives it that turn's blocks; it hits at least 0.97x what cache-aware routing hits without a
    store (a store holds whole blocks only: each turn may give up the last few tokens of the
    previous one, under 3 of a block of 4), and clearly more than round robin without it."""
    rng = random.Random(8)
    systems = [[rng.randrange(256) for _ in range(64)] for _ in range(2)]
    sessions = [  # 5 sessions in 2 groups, 4 turns each
        [systems[i % 2]] + [[rng.randrange(256) for _ in range(rng.randrange(6, 12))] for _ in range(4)]
        for i in range(5)
    ]

    def replicas(store: str | None) -> list[Engine]:
        kwargs = {"block_size": 4, "kv_cache_memory": "2MiB", "kv_store": store}
        return [Engine.from_pretrained(model_folders["llama"], **kwargs) for _ in range(2)]

    rates, outputs = {}, {}
    for name, policy, store in (
        ("cache-aware", "cache-aware", None),
        ("round-robin", "round-robin", None),
        ("round-robin + store", "round-robin", redis_url),
    ):
        engines = replicas(store)
        try:
            rates[name], outputs[name] = routed_hit_rate(engines, policy, sessions)
        finally:
            for e in engines:
                e.close()
    assert outputs["round-robin + store"] == outputs["cache-aware"] == outputs["round-robin"]  # greedy
    assert rates["round-robin + store"] >= 0.97 * rates["cache-aware"], rates
    assert rates["round-robin"] < 0.9 * rates["cache-aware"], rates
