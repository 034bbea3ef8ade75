"""`radixkv bench kernels`: the Triton paged-attention kernel against the plain-torch reference.

Three float32 cases, each with 8 query heads over 2 KV heads, head size 64, block size 16 and the
physical blocks shuffled: decode (32 sequences, 1 new token each, 1,024 tokens in all), extend
(4 sequences, 512 new tokens after 1,536 cached) and prefill (2 sequences of 2,048 new tokens).
For each case the kernel, then the reference, is warmed up once and timed `--repeats` times; the
medians are reported with their ratio (Triton / reference) and the largest difference of outputs.
On a machine without a GPU both run on the CPU, Triton through its interpreter.
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
from radixkv.kernels.paged_attention import paged_attention
from radixkv.kernels.reference import paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
MAX_ABS_ERR = 1e-4
"""float32 outputs further apart than this mean a broken kernel: the command then exits with 1."""


class Case(NamedTuple):
    name: str
    num_seqs: int
    new_tokens: int
    seq_len: int


CASES = (Case("decode", 32, 1, 1024), Case("extend", 4, 512, 2048), Case("prefill", 2, 2048, 2048))


class CaseResult(NamedTuple):
    case: str
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
        print(f"paged attention, float32, {NUM_HEADS} query heads / {NUM_KV_HEADS} KV heads, head size "
              f"{HEAD_DIM}, block size {BLOCK_SIZE}; {backend}; median of {args.repeats}")
        print(f"{'case':<8} {'seqs':>4} {'new':>5} {'len':>5} {'triton ms':>10} {'torch ms':>9} {'ratio':>6} "
              f"{'max err':>8}", flush=True)
    results = []
    for case in CASES:
        result = _run_case(case, device, args.repeats)
        results.append(result)
        if not args.json:
            print(f"{result.case:<8} {result.num_seqs:>4} {result.new_tokens:>5} {result.seq_len:>5} "
                  f"{result.triton_ms:>10.1f} {result.reference_ms:>9.1f} {result.ratio:>6.2f} "
                  f"{result.max_abs_err:>8.1e}", flush=True)
    if args.json:
        report = {
            "backend": backend, "dtype": "float32", "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "repeats": args.repeats,
            "cases": [r._asdict() for r in results],
        }
        print(json.dumps(report, indent=2))
    broken = [r.case for r in results if r.max_abs_err > MAX_ABS_ERR]
    if broken:
        print(f"kernel output differs from the reference by more than {MAX_ABS_ERR} in: {', '.join(broken)}",
              file=sys.stderr)
        return 1
    return 0


def _run_case(case: Case, device: torch.device, repeats: int) -> CaseResult:
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
    kernel_out, kernel_ms = _median_ms(lambda: paged_attention(*inputs), repeats, device)
    reference_out, reference_ms = _median_ms(lambda: paged_attention_ref(*inputs), repeats, device)
    return CaseResult(
        case.name, case.num_seqs, case.new_tokens, case.seq_len, kernel_ms, reference_ms,
        kernel_ms / reference_ms, (kernel_out - reference_out).abs().max().item(),
    )


def _median_ms(
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
