"""Tensor parallelism with 2 ranks over gloo on this CPU, against the single-rank engine and transformers.

A 2-rank engine starts a worker process (the first of the session waits seconds for the fork
server's imports), so the Llama pair is built once for the module and every test runs the same
operations on both engines, which therefore stay in the same state. The two are sized to the same
number of blocks (a rank holds half the KV heads, so the 2-rank engine gets half the bytes) and
small enough that the batches below preempt.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_SIZES
from processes import children, reaped
from test_engine import no_leaks, prompts, transformers_greedy
from transformers import LlamaConfig, MistralConfig

from radixkv import AsyncEngine, BeamSearchParams, Engine, EngineConfig, RequestError, SamplingParams
from radixkv.cli import main
from radixkv.errors import TensorParallelError
from radixkv.model.loader import build_random_model
from radixkv.model.parallel_runner import ParallelRunner
from radixkv.model.tensor_parallel import plan_shards
from radixkv.model.tokenizer import build_byte_tokenizer
from radixkv.scheduler.chunk import SequenceChunk

pytestmark = pytest.mark.slow  # every test starts tensor-parallel worker processes

ATOL = 1e-4
BLOCK = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def engine_pair(
    folder: Path, kv_bytes: int, rank_kv_bytes: int, host_bytes: int = 0, **kw: object
) -> tuple[Engine, Engine]:
    """A single-rank and a 2-rank engine over the same weights and the same number of blocks
    (`rank_kv_bytes` per rank: half of `kv_bytes` when the ranks split the KV heads; likewise
    half of `host_bytes` for the host tier)."""
    kw = {"block_size": BLOCK, "device": "cpu", **kw}
    one = Engine.from_pretrained(folder, kv_cache_memory=kv_bytes, host_kv_cache_memory=host_bytes, **kw)
    two = Engine.from_pretrained(
        folder,
        kv_cache_memory=rank_kv_bytes,
        host_kv_cache_memory=host_bytes // 2,
        tensor_parallel_size=2,
        **kw,
    )
    assert isinstance(two.runner, ParallelRunner)
    assert two.pool.num_blocks == one.pool.num_blocks
    for engine in (one, two):
        engine.step_hooks.append(Engine.check_invariants)
    return one, two


@pytest.fixture(scope="module")
def llama(model_folders):
    # 2 layers x 2 KV heads (1 a rank) x 16 dims x 4 tokens x 2 (K and V) x 4 bytes: 48 blocks.
    one, two = engine_pair(model_folders["llama"], 96 << 10, 48 << 10)
    yield one, two
    two.close()


def test_logits_match_one_rank_for_prefill_extend_and_decode(llama) -> None:
    """The runners alone, over blocks taken from each pool in one shuffled order."""
    one, two = llama
    rng = random.Random(0)
    order = rng.sample(range(24), 24)
    tables = []
    for engine in (one, two):
        blocks = engine.pool.allocate(24)
        tables.append([[blocks[i] for i in order[k : k + 8]] for k in (0, 8, 16)])
    seqs = prompts(3, seed=3, low=9, high=20)
    cuts = [len(s) // 2 for s in seqs]

    def steps(table: list[list[int]]) -> list[list[SequenceChunk]]:
        prefill = [SequenceChunk(s[:c], 0, t, "all") for s, c, t in zip(seqs, cuts, table, strict=True)]
        extend = [SequenceChunk(s[c:], c, t, "all") for s, c, t in zip(seqs, cuts, table, strict=True)]
        decode = [SequenceChunk([s[0]], len(s), t) for s, t in zip(seqs, table, strict=True)]
        return [prefill, extend, decode]

    try:
        for step_one, step_two in zip(steps(tables[0]), steps(tables[1]), strict=True):
            expected = one.runner.forward(step_one)
            torch.testing.assert_close(two.runner.forward(step_two), expected, atol=ATOL, rtol=0)
    finally:
        for engine, table in zip((one, two), tables, strict=True):
            for block in (b for row in table for b in row):
                engine.pool.decref(block)
    assert two.pool.num_free == one.pool.num_free == one.pool.num_blocks


def test_every_rank_profiles_its_kv_budget_in_step(llama) -> None:
    """The budget protocol (on CUDA a profiling forward on every rank); on the CPU each rank's
    share of free RAM, and the engine steps on in step afterwards."""
    one, two = llama
    limits = {"block_size": BLOCK, "max_num_batched_tokens": 64, "max_model_len": 128}
    budget = two.runner.kv_cache_budget(two.model, gpu_memory_utilization=0.9, **limits)
    assert 0 < budget <= 1 << 30
    assert two.generate([[9, 8, 7]], GREEDY)[0].token_ids == one.generate([[9, 8, 7]], GREEDY)[0].token_ids


def test_a_step_every_rank_refuses_fails_alone_and_the_ranks_stay_in_step(llama) -> None:
    one, two = llama
    with pytest.raises(ValueError, match="block ids must be in"):
        two.runner.forward([SequenceChunk([1, 2], 0, [two.pool.num_blocks])])
    assert two.generate([[5, 6, 7]], GREEDY)[0].token_ids == one.generate([[5, 6, 7]], GREEDY)[0].token_ids


def test_greedy_under_preemption_matches_one_rank_and_transformers(llama, reference_models) -> None:
    one, two = llama
    batch = prompts(6, seed=2, low=20, high=32)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in one.generate(batch, params)]
    assert [o.token_ids for o in two.generate(batch, params)] == expected
    assert two.metrics()["num_preemptions"] == one.metrics()["num_preemptions"] > 0
    for prompt, tokens in list(zip(batch, expected, strict=True))[:2]:
        assert tokens == transformers_greedy(reference_models["llama"], prompt, 16)
    no_leaks(two)


def test_beam_search_matches_one_rank(llama) -> None:
    one, two = llama
    prompt = prompts(1, seed=5, low=20, high=30)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    theirs, ours = one.beam_search(prompt, params), two.beam_search(prompt, params)
    assert [b.token_ids for b in ours] == [b.token_ids for b in theirs]
    assert [b.score for b in ours] == pytest.approx([b.score for b in theirs], abs=1e-5)
    no_leaks(two)


def test_abort_and_prefix_hits_match_one_rank(llama) -> None:
    one, two = llama
    shared = prompts(1, seed=6, low=24, high=25)[0]
    long = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(engine: Engine) -> tuple[list[list[int]], list[str], list[int]]:
        ids = [engine.add_request(shared + [i], long) for i in range(3)]
        for _ in range(3):
            engine.step()
        engine.abort(ids[1])
        engine.run_until(lambda: all(engine.is_finished(i) for i in ids))
        outs = [engine.output(i) for i in ids]
        again = engine.generate([shared + [7, 8]], GREEDY)[0]
        no_leaks(engine)
        reasons = [o.finish_reason for o in outs]
        cached = [o.num_cached_tokens for o in outs] + [again.num_cached_tokens]
        return [o.token_ids for o in outs] + [again.token_ids], reasons, cached

    expected = run(one)
    assert run(two) == expected
    assert expected[1] == ["length", "abort", "length"]
    assert expected[2][-1] >= len(shared) - BLOCK  # the last prompt hits the shared prefix


def test_a_core_in_its_own_process_runs_two_ranks_and_stops_them(llama, model_folders) -> None:
    """`AsyncEngine`'s core process owns the tensor-parallel workers: outputs equal the
    single-rank engine's, and shutting down leaves neither the core nor a worker behind."""
    one, _ = llama
    batch = prompts(4, seed=8, low=10, high=20)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in one.generate(batch, params)]
    config = EngineConfig(
        model=str(model_folders["llama"]),
        block_size=BLOCK,
        device="cpu",
        kv_cache_memory=48 << 10,
        tensor_parallel_size=2,
    )

    async def main() -> tuple[int, list[int]]:
        engine = AsyncEngine(config)
        try:
            outs = await asyncio.gather(*(engine.generate(p, params) for p in batch))
            assert [o.token_ids for o in outs] == expected
            engine.check_invariants()
            core = engine.core.pid
            return core, children(core)
        finally:
            await engine.shutdown()

    core, workers = asyncio.run(main())
    assert workers, "the core started no worker process"
    deadline = time.monotonic() + 30
    while not all(reaped(pid) for pid in [core, *workers]):
        assert time.monotonic() < deadline, "the core or a worker outlived the shutdown"
        time.sleep(0.05)


def test_swap_preemption_through_the_host_tier_matches_one_rank(model_folders) -> None:
    """Offloads and loads run on every rank, in order with the copies, each over its own heads."""
    one, two = engine_pair(model_folders["llama"], 96 << 10, 48 << 10, 256 << 10, preemption_mode="swap")
    with two:
        batch = prompts(6, seed=2, low=20, high=32)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        expected = [o.token_ids for o in one.generate(batch, params)]
        assert [o.token_ids for o in two.generate(batch, params)] == expected
        assert two.metrics()["num_preemptions"] == one.metrics()["num_preemptions"] > 0
        assert two.metrics()["num_swapped_in_blocks"] == one.metrics()["num_swapped_in_blocks"] > 0
        no_leaks(two)


def test_a_killed_worker_fails_the_caller_within_seconds_and_leaves_no_process(llama) -> None:
    """Last of the Llama tests: it ends the module's 2-rank engine."""
    _, engine = llama
    (pid,) = engine.runner.worker_pids
    steps_before = engine.num_steps
    killed_at: list[float] = []
    prompt = prompts(1, seed=8)[0]

    def kill_once_generating() -> None:
        deadline = time.monotonic() + 120
        while engine.num_steps < steps_before + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_generating)
    killer.start()
    with pytest.raises(RequestError) as caught:
        engine.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    failed_after = time.monotonic() - killed_at[0]
    killer.join()
    assert isinstance(caught.value.__cause__, TensorParallelError)
    assert "rank 1 died (signal SIGKILL)" in str(caught.value)
    assert failed_after < 5, f"the caller waited {failed_after:.1f} s"
    assert reaped(pid) and not multiprocessing.active_children()
    with pytest.raises(RequestError, match="rank 1 died"):  # the engine refuses work, without hanging
        engine.generate([prompt], GREEDY)


def test_a_size_the_heads_do_not_allow_fails_before_any_process(model_folders, monkeypatch) -> None:
    before = set(multiprocessing.active_children())  # a module engine's workers may be alive
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the 4 heads"):
        Engine.from_pretrained(model_folders["llama"], tensor_parallel_size=3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 CUDA devices, but 1 are visible"):
        Engine(EngineConfig(model=str(model_folders["llama"]), tensor_parallel_size=2, device="cuda"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    assert set(multiprocessing.active_children()) <= before


def test_each_rank_keeps_the_kv_head_its_query_heads_attend_to() -> None:
    """8 query heads over 2 KV heads on 4 ranks: each KV head is replicated on two ranks."""
    sizes = {**TINY_SIZES, "num_attention_heads": 8, "num_key_value_heads": 2}
    config = LlamaConfig(architectures=["LlamaForCausalLM"], head_dim=8, **sizes)
    loaded = build_random_model(config, dtype="float32", device="cpu")
    specs = {s.name.rsplit(".", 1)[-1]: s for s in plan_shards(loaded, 4)}
    group = 8 // 2
    for rank in range(4):
        q, k, v = (specs[name].keep(rank) for name in ("q_proj", "k_proj", "v_proj"))
        q_heads = range(q.start // 8, q.stop // 8)
        assert len(q_heads) == 2 and k == v and (k.stop - k.start) == 8
        assert {h // group for h in q_heads} == {k.start // 8}
    assert specs["o_proj"].keep(3) == slice(48, 64) and specs["down_proj"].keep(1) == slice(32, 64)


def _mistral_one_kv_head_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """Mistral with one KV head, so each of 2 ranks holds a replica of it, and a 64-token window."""
    sizes = {**TINY_SIZES, "num_key_value_heads": 1}
    config = MistralConfig(architectures=["MistralForCausalLM"], head_dim=16, sliding_window=64, **sizes)
    model = build_random_model(config, dtype=torch.float32, device="cpu", seed=1).model
    folder = tmp_path_factory.mktemp("mistral-kv1")
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_greedy_matches_one_rank_and_transformers(arch, model_folders, reference_models, tmp_path_factory):
    if arch == "qwen2":
        folder, reference = model_folders["qwen2"], reference_models["qwen2"]
        one, two = engine_pair(folder, 256 << 10, 128 << 10)
    else:  # one KV head: each rank holds all of it
        folder, reference = _mistral_one_kv_head_folder(tmp_path_factory)
        one, two = engine_pair(folder, 128 << 10, 128 << 10)
    with two:  # the context manager closes the engine, stopping its worker
        batch = prompts(3, seed=4)
        expected = [o.token_ids for o in one.generate(batch, GREEDY)]
        assert [o.token_ids for o in two.generate(batch, GREEDY)] == expected
        assert expected == [transformers_greedy(reference, p, 10) for p in batch]
        no_leaks(two)
        pids = two.runner.worker_pids
    assert all(reaped(pid) for pid in pids)
    with pytest.raises(RequestError) as caught:  # a closed engine fails requests, without hanging
        two.generate(batch, GREEDY)
    assert isinstance(caught.value.__cause__, TensorParallelError)


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "workloads/shared_prefix_small.jsonl"],
        ["chat"],
        ["bench", "tp", "--device", "cpu"],
        ["serve", "--port", "0"],
    ],
)
def test_every_engine_command_takes_the_size_to_the_engine(argv, capsys) -> None:
    """3 ranks over tiny-llama's 8 query heads reaches the engine's check, before any process."""
    before = set(multiprocessing.active_children())  # a module engine's workers may be alive
    assert main([*argv, "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size 3 does not divide the 8 heads" in capsys.readouterr().err
    assert set(multiprocessing.active_children()) <= before
