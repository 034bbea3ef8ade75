"""The GPU suite: `pytest -m gpu`, skipped without CUDA.

Compiled (not interpreted) kernels against the plain-torch reference in float16 and bfloat16, the
engine's greedy and beam outputs against transformers on CUDA (CUDA graphs on, and off; with
sliding-window KV groups too), steps
that make no tensor off the engine's device, and the decode bandwidth benchmark.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import random

import pytest
import torch
from test_cache_ops import assert_store_then_copy_match_reference

from radixkv import BeamSearchParams, Engine, EngineConfig, SamplingParams
from radixkv.cli import main
from radixkv.kernels import paged_attention
from radixkv.kernels.dispatch import interpreted
from radixkv.kernels.reference import paged_attention_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (new tokens, cached tokens): decodes, a prefill, extends, lengths off every block boundary.
MIXED = [(1, 37), (1, 0), (19, 0), (5, 60), (1, 130), (33, 17), (2, 1), (1, 4095), (64, 700)]


def random_batch(dtype: torch.dtype, head_dim: int, block_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = 8, 2
    seq_lens = [new + cached for new, cached in MIXED]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.zeros((len(MIXED), max(blocks)), dtype=torch.int32)
    first = 0
    for i, b in enumerate(blocks):
        table[i, :b] = torch.tensor(physical[first : first + b])
        first += b
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(CUDA, dtype)
    v_cache = torch.randn(shape, generator=generator).to(CUDA, dtype)
    q_lens = [new for new, _ in MIXED]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=generator).to(CUDA, dtype)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(CUDA, torch.int32)
    return q, k_cache, v_cache, table.to(CUDA), torch.tensor(seq_lens, dtype=torch.int32, device=CUDA), starts


def test_kernels_are_compiled_on_cuda_tensors():
    assert not interpreted(CUDA)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size"), [(128, 16), (64, 32), (96, 16), (256, 8)])
def test_compiled_paged_attention_matches_the_reference(dtype, head_dim, block_size):
    batch = random_batch(dtype, head_dim, block_size)
    ours = paged_attention(*batch)
    torch.cuda.synchronize()
    reference = paged_attention_ref(*batch)
    torch.testing.assert_close(ours.float(), reference.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_store_and_copy_match_the_reference(dtype):
    generator = torch.Generator().manual_seed(1)
    k_cache = torch.randn(16, 16, 4, 128, generator=generator).to(CUDA, dtype)
    v_cache = torch.randn(16, 16, 4, 128, generator=generator).to(CUDA, dtype)
    k, v = torch.randn(2, 40, 4, 128, generator=generator).to(CUDA, dtype)
    slots = torch.randperm(256, generator=generator)[:40].to(CUDA)
    slots[::7] = -1
    assert_store_then_copy_match_reference(k_cache, v_cache, k, v, slots)


def cuda_reference(reference_models, name: str):
    return copy.deepcopy(reference_models[name]).to(CUDA)


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=CUDA),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=CUDA),
        do_sample=False,
        max_new_tokens=max_tokens,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_engine_greedy_matches_transformers_on_cuda(model_folders, reference_models, enforce_eager):
    reference = cuda_reference(reference_models, "llama")
    engine = Engine.from_pretrained(
        model_folders["llama"],
        dtype="float32",
        device="cuda",
        block_size=16,
        kv_cache_memory="64MiB",
        enforce_eager=enforce_eager,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(4, 60))] for _ in range(12)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == greedy_reference(reference, prompt, 24)
    assert (engine.runner.graphs is None) == enforce_eager
    if not enforce_eager:
        assert not engine.runner.graphs.failed, "a decode graph failed to capture; the engine ran eagerly"
    engine.check_invariants()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_kv_groups_on_cuda_match_transformers_with_graphs_on_and_off(enforce_eager):
    """Gemma 3's six KV groups (`radixkv.cache.kv_groups`) on CUDA, decode graphs replaying every
    group's slots and tables: greedy tokens past the 32-token window, the later prompts hitting
    the first's prefix, equal transformers' (teacher-forced)."""
    from radixkv.model.loader import load_model

    reference = load_model("tiny-gemma3", dtype="float32", device="cuda").model
    engine = Engine(
        EngineConfig(
            model="tiny-gemma3",
            dtype="float32",
            device="cuda",
            block_size=16,
            kv_cache_memory="16MiB",
            enforce_eager=enforce_eager,
        )
    )
    assert len(engine.kv.windows) == 5
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(70)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(4, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outs = [*engine.generate(prompts[:1], params), *engine.generate(prompts[1:], params)]
    assert outs[1].num_cached_tokens >= 64
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt + out.token_ids], device=CUDA)
            expected = reference(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        assert out.token_ids == expected
    assert (engine.runner.graphs is None) == enforce_eager
    if not enforce_eager:
        assert not engine.runner.graphs.failed, "a decode graph failed to capture; the engine ran eagerly"
    engine.check_invariants()


def test_beam_search_on_cuda_matches_transformers(model_folders, reference_models):
    reference = cuda_reference(reference_models, "qwen2")
    engine = Engine.from_pretrained(
        model_folders["qwen2"], dtype="float32", device="cuda", block_size=4, kv_cache_memory="64MiB"
    )
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=1.0, early_stopping=True)
    rng = random.Random(4)
    for _ in range(4):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(3, 20))]
        out = reference.generate(
            torch.tensor([prompt], device=CUDA),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=CUDA),
            num_beams=4,
            num_return_sequences=4,
            length_penalty=1.0,
            early_stopping=True,
            do_sample=False,
            max_new_tokens=12,
            pad_token_id=reference.config.pad_token_id,
        )
        pad = reference.config.pad_token_id
        expected = []
        for seq in out.tolist():
            generated = seq[len(prompt) :]
            while generated and generated[-1] == pad:
                generated.pop()
            expected.append(generated)
        beams = engine.beam_search(prompt, params)
        assert beams[0].token_ids == expected[0]
        assert sorted(b.token_ids for b in beams) == sorted(expected)


def test_cuda_steps_make_no_tensor_on_the_default_device(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], device="cuda", kv_cache_memory="64MiB")
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1)
    ids = [
        engine.add_request(list(range(30, 70)), sampled),
        engine.add_request(list(range(30, 60)), BeamSearchParams(beam_width=3, max_tokens=6)),
    ]
    with torch.device("meta"):
        engine.run_until(lambda: all(engine.is_finished(i) for i in ids))
    assert len(engine.output(ids[0]).token_ids) == 8 and len(engine.beam_output(ids[1])) == 3


def test_auto_dtype_on_cuda_follows_the_checkpoint(model_folders):
    saved = Engine.from_pretrained(model_folders["llama"], device="cuda", kv_cache_memory="64MiB")
    assert saved.model.dtype == saved.runner.kv_cache.dtype == torch.float32  # saved in float32
    preset = Engine(EngineConfig(model="tiny-llama", device="cuda", kv_cache_memory="64MiB"))
    assert preset.model.dtype == torch.bfloat16  # random weights record no dtype


def test_kv_budget_comes_from_a_profiling_forward(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], device="cuda", gpu_memory_utilization=0.05)
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()
    assert 0 < kv_bytes <= 0.05 * total


def test_bench_kernels_reports_decode_bandwidth_against_the_peak():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "kernels", "--json", "--repeats", "3"]) == 0
    bandwidth = json.loads(out.getvalue())["bandwidth"]
    assert bandwidth["num_seqs"] == 64 and bandwidth["seq_len"] == 4096 and bandwidth["head_dim"] == 128
    assert 0 < bandwidth["fraction_of_peak"] <= 1.0


def test_layered_loads_on_a_side_stream_equal_copies_made_at_once(monkeypatch):
    """The runner's copies, offloads and loads on CUDA (pinned host tier, loads on the side
    stream, one event per layer) leave the device and host tensors as a CPU reference that makes
    every copy when it is called."""
    from conftest import _llama_gqa_config
    from test_layered_load import check_transfers_against_copies_at_once

    from radixkv.model.loader import build_random_model
    from radixkv.model.runner import ModelRunner

    loaded = build_random_model(_llama_gqa_config(), dtype=torch.float32, device="cuda", seed=0)
    runner = ModelRunner(loaded, num_blocks=64, block_size=16, num_host_blocks=48)
    assert runner.load_stream is not None and runner.host.tensor.is_pinned()
    check_transfers_against_copies_at_once(runner, monkeypatch, steps=40)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_host_tier_loads_on_cuda_match_transformers(model_folders, reference_models, enforce_eager):
    """Multi-turn chats over 24 device blocks and a host tier: later turns load earlier turns
    back, layer by layer on the runner's side stream (each layer's event recorded there and
    waited for), and every answer equals transformers' greedy one on CUDA."""
    from test_layered_load import chat_turns

    reference = cuda_reference(reference_models, "llama")
    engine = Engine.from_pretrained(
        model_folders["llama"],
        dtype="float32",
        device="cuda",
        block_size=4,
        kv_cache_memory="48KiB",
        host_kv_cache_memory="256KiB",
        enforce_eager=enforce_eager,
    )
    engine.step_hooks.append(Engine.check_invariants)
    turns = chat_turns(engine, num_chats=6, num_turns=3)
    m = engine.metrics()
    assert m["num_loaded_blocks"] > 0 and m["host_cache_hits"] > 0
    runner = engine.runner
    assert runner.num_layered_loads > 0 and runner.last_load.stream is runner.load_stream is not None
    events = runner.last_load.events
    assert len(events) == runner.kv_cache.shape[1] and all(event.query() for event in events)
    for prompt, answer in turns:
        assert answer == greedy_reference(reference, prompt, 8)
    if not enforce_eager:
        assert not runner.graphs.failed


def test_swap_preemption_on_cuda_finishes_loads_before_a_graph_replay(model_folders, reference_models):
    """Swapped-out decodes come back in pure decode steps, which replay CUDA graphs: their loads
    are finished (the compute stream waits on every layer) before the replay, and every output
    equals transformers' greedy one on CUDA."""
    from test_engine_host_tier import prompts

    reference = cuda_reference(reference_models, "llama")
    engine = Engine.from_pretrained(
        model_folders["llama"],
        dtype="float32",
        device="cuda",
        block_size=4,
        kv_cache_memory="104KiB",
        host_kv_cache_memory="512KiB",
        preemption_mode="swap",
    )
    batch = prompts(6, seed=2, low=20, high=40)
    outs = engine.generate(batch, SamplingParams(max_tokens=24, temperature=0.0))
    m = engine.metrics()
    assert m["num_preemptions"] > 0 and m["num_swapped_in_blocks"] > 0
    assert engine.runner.num_early_loads > 0 and not engine.runner.graphs.failed
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == greedy_reference(reference, prompt, 24)
    engine.check_invariants()


def test_a_step_still_running_on_the_device_is_not_done_before_its_deadline():
    import time

    from radixkv.model.parallel_runner import device_done

    torch.cuda.synchronize()
    assert device_done(CUDA, time.monotonic() + 1.0)
    torch.cuda._sleep(2_000_000_000)  # about a second of spinning on the current stream
    assert not device_done(CUDA, time.monotonic() + 0.01)
    assert device_done(CUDA, time.monotonic() + 30.0)


def test_an_offload_through_pinned_staging_moves_every_block_to_its_place():
    from radixkv.model.host_kv import OFFLOAD_CHUNK_BLOCKS, HostKVCache

    device_cache = torch.randn((2, 3, 100, 4, 2, 8), device=CUDA, dtype=torch.bfloat16)
    host = HostKVCache(90, device_cache)
    count = 2 * OFFLOAD_CHUNK_BLOCKS + 5
    src = random.Random(0).sample(range(100), count)
    dst = random.Random(1).sample(range(90), count)
    host.offload(device_cache, src, dst)
    assert host.tensor.is_pinned() and host._staging.is_pinned()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(host.tensor[:, :, d], device_cache[:, :, s].cpu())
