"""`radixkv bench kernels`: the Triton paged-attention kernel against the plain-torch reference.

Three float32 cases, each with 8 query heads over 2 KV heads, head size 64, block size 16 and the
physical blocks shuffled: decode (32 sequences, 1 new token each, 1,024 tokens in all), extend
(4 sequences, 512 new tokens after 1,536 cached) and prefill (2 sequences of 2,048 new tokens).
For each case the kernel, then the reference, is warmed up once and timed `--repeats` times; the
medians are reported with their ratio (Triton / reference) and the largest difference of outputs.
Each case runs twice: over a float32 cache (`kv auto`) and over an int8 cache with per-token,
per-head one-byte scale codes as the engine stores them (`kv int8`, the caches quantized by the
reference's `quantize_ref`, the
reference then attending over their dequantized values), the row beside its full-precision one.
On a machine without a GPU both run on the CPU, Triton through its interpreter.

On a GPU it also measures decode bandwidth: 64 sequences of 4,096 tokens, head size 128, bfloat16,
32 query heads over 8 KV heads (Llama-3-8B's attention), block size 16, one new token each. Decode
reads every cached K and V once, so bytes read / kernel time is its bandwidth, reported against the
device's peak (`radixkv.tools.device_peaks.peak_bandwidth`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from radixkv.kernels.launch_plan import INTERPRETED
from radixkv.kernels.paged_attention import paged_attention, plan_paged_attention
from radixkv.kernels.reference import paged_attention_ref, quantize_ref
from radixkv.kernels.scale_code import SCALE_CODE_DTYPE
from radixkv.tools.device_peaks import peak_bandwidth

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
MAX_ABS_ERR = 1e-4
"""float32 outputs further apart than this mean a broken kernel: the command then exits with 1."""
BF16_MAX_ABS_ERR = 3e-2
"""The same for the bfloat16 bandwidth case (bfloat16 keeps 8 bits of mantissa)."""


class Case(NamedTuple):
    name: str
    num_seqs: int
    new_tokens: int
    seq_len: int


CASES = (Case("decode", 32, 1, 1024), Case("extend", 4, 512, 2048), Case("prefill", 2, 2048, 2048))
BANDWIDTH_CASE = Case("decode_bandwidth", 64, 1, 4096)
BANDWIDTH_HEADS, BANDWIDTH_KV_HEADS, BANDWIDTH_HEAD_DIM = 32, 8, 128


class BandwidthResult(NamedTuple):
    num_seqs: int
    seq_len: int
    head_dim: int
    dtype: str
    kernel_ms: float
    gb_per_s: float
    peak_gb_per_s: float
    fraction_of_peak: float
    max_abs_err: float


class CaseResult(NamedTuple):
    case: str
    kv_cache_dtype: str
    num_seqs: int
    new_tokens: int
    seq_len: int
    triton_ms: float
    reference_ms: float
    ratio: float
    max_abs_err: float


def run(args: argparse.Namespace) -> int:
    """Run the three cases, print a table (or JSON with --json); 1 if an output is wrong, else 0."""
    device = torch.device("cpu" if INTERPRETED else "cuda")
    backend = "Triton interpreter, CPU" if INTERPRETED else f"Triton, {torch.cuda.get_device_name(device)}"
    if not args.json:
        print(
            f"paged attention, float32, {NUM_HEADS} query heads / {NUM_KV_HEADS} KV heads, head size "
            f"{HEAD_DIM}, block size {BLOCK_SIZE}; {backend}; median of {args.repeats}"
        )
        print(
            f"{'case':<8} {'kv':<5} {'seqs':>4} {'new':>5} {'len':>5} {'triton ms':>10} {'torch ms':>9} "
            f"{'ratio':>6} {'max err':>8}",
            flush=True,
        )
    results = []
    for case in CASES:
        for kv_cache_dtype in ("auto", "int8"):
            r = _run_case(case, device, args.repeats, kv_cache_dtype)
            results.append(r)
            if not args.json:
                print(
                    f"{r.case:<8} {r.kv_cache_dtype:<5} {r.num_seqs:>4} {r.new_tokens:>5} {r.seq_len:>5} "
                    f"{r.triton_ms:>10.1f} {r.reference_ms:>9.1f} {r.ratio:>6.2f} {r.max_abs_err:>8.1e}",
                    flush=True,
                )
    bandwidth = None if INTERPRETED else _decode_bandwidth(device, args.repeats)
    if bandwidth is not None and not args.json:
        b = bandwidth
        print(
            f"decode bandwidth, {b.num_seqs} x {b.seq_len} tokens, head size {b.head_dim}, {b.dtype}: "
            f"{b.kernel_ms:.3f} ms, {b.gb_per_s:.0f} GB/s = {b.fraction_of_peak:.2f} of the peak "
            f"{b.peak_gb_per_s:.0f} GB/s (max err {b.max_abs_err:.1e})",
            flush=True,
        )
    if args.json:
        report = {
            "backend": backend,
            "dtype": "float32",
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "repeats": args.repeats,
            "cases": [r._asdict() for r in results],
            "bandwidth": bandwidth._asdict() if bandwidth is not None else None,
        }
        print(json.dumps(report, indent=2))
    broken = [f"{r.case} ({r.kv_cache_dtype})" for r in results if r.max_abs_err > MAX_ABS_ERR]
    if bandwidth is not None and bandwidth.max_abs_err > BF16_MAX_ABS_ERR:
        broken.append(BANDWIDTH_CASE.name)
    if broken:
        print(
            f"kernel output differs from the reference by more than {MAX_ABS_ERR} in: {', '.join(broken)}",
            file=sys.stderr,
        )
        return 1
    return 0


def _run_case(case: Case, device: torch.device, repeats: int, kv_cache_dtype: str) -> CaseResult:
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-case.seq_len // BLOCK_SIZE)
    num_blocks = case.num_seqs * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, generator=generator).to(device)
    v_cache = torch.randn(cache_shape, generator=generator).to(device)
    block_table = torch.randperm(num_blocks, generator=generator).view(case.num_seqs, blocks_per_seq)
    inputs = (
        torch.randn(case.num_seqs * case.new_tokens, NUM_HEADS, HEAD_DIM, generator=generator).to(device),
        k_cache,
        v_cache,
        block_table.to(device, torch.int32),
        torch.full((case.num_seqs,), case.seq_len, dtype=torch.int32, device=device),
        torch.arange(0, case.num_seqs + 1, dtype=torch.int32, device=device) * case.new_tokens,
    )
    scales, k_v = {}, inputs[1:3]
    if kv_cache_dtype == "int8":
        (k_cache, k_scale), (v_cache, v_scale) = (quantize_ref(c, torch.int8, SCALE_CODE_DTYPE) for c in k_v)
        inputs = (inputs[0], k_cache, v_cache, *inputs[3:])
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    kernel_out, kernel_ms = median_ms(lambda: paged_attention(*inputs, **scales), repeats, device)
    reference_out, reference_ms = median_ms(lambda: paged_attention_ref(*inputs, **scales), repeats, device)
    return CaseResult(
        case.name,
        kv_cache_dtype,
        case.num_seqs,
        case.new_tokens,
        case.seq_len,
        kernel_ms,
        reference_ms,
        kernel_ms / reference_ms,
        (kernel_out - reference_out).abs().max().item(),
    )


def _decode_bandwidth(device: torch.device, repeats: int) -> BandwidthResult:
    """The GPU decode case: bytes of K and V read per call over the mean time of back-to-back calls
    (CUDA events around them, launches planned once so the host keeps ahead of the GPU), against
    the device's peak bandwidth; the output checked against the reference."""
    case, dtype = BANDWIDTH_CASE, torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = case.seq_len // BLOCK_SIZE
    num_blocks = case.num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, BANDWIDTH_KV_HEADS, BANDWIDTH_HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(device, dtype)
    v_cache = torch.randn(shape, generator=generator).to(device, dtype)
    table = torch.randperm(num_blocks, generator=generator).view(case.num_seqs, blocks_per_seq)
    q = torch.randn(case.num_seqs, BANDWIDTH_HEADS, BANDWIDTH_HEAD_DIM, generator=generator)
    inputs = (
        q.to(device, dtype),
        k_cache,
        v_cache,
        table.to(device, torch.int32),
        torch.full((case.num_seqs,), case.seq_len, dtype=torch.int32, device=device),
        torch.arange(0, case.num_seqs + 1, dtype=torch.int32, device=device),
    )
    _, _, _, block_table, seq_lens, query_start_loc = inputs
    launches = plan_paged_attention(
        query_start_loc,
        seq_lens,
        block_table,
        num_tokens=case.num_seqs,
        num_heads=BANDWIDTH_HEADS,
        num_kv_heads=BANDWIDTH_KV_HEADS,
        head_dim=BANDWIDTH_HEAD_DIM,
        block_size=BLOCK_SIZE,
    )
    out = paged_attention(*inputs, launches=launches)  # compiles
    calls = max(repeats, 50)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        paged_attention(*inputs, out=out, launches=launches)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / calls
    error = (out.float() - paged_attention_ref(*inputs).float()).abs().max().item()
    read = 2 * k_cache.numel() * k_cache.element_size()
    peak = peak_bandwidth(device)
    gb_per_s = read / (ms * 1e-3) / 1e9
    fraction = gb_per_s * 1e9 / peak
    return BandwidthResult(
        case.num_seqs, case.seq_len, BANDWIDTH_HEAD_DIM, "bfloat16", ms, gb_per_s, peak / 1e9, fraction, error
    )


def median_ms(
    fn: Callable[[], torch.Tensor], repeats: int, device: torch.device
) -> tuple[torch.Tensor, float]:
    """The warm-up call's result and the median wall milliseconds of `repeats` more calls.

    Each side is timed in its own run of calls rather than alternated: the interpreter's large numpy
    temporaries otherwise leave the allocator cold for the reference, which then measured up to 2x
    slower than on its own.
    """
    result = fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)
