"""How many bytes the KV cache gets when the user sets none.

On CUDA, as vLLM sizes it: run one forward at the largest step the scheduler can make
(`max_num_batched_tokens` new tokens, in sequences of at most `max_model_len - 1`) through a
runner holding just the blocks it needs, and read the allocator's peak: weights plus the
activations of that step. The cache gets what remains of `gpu_memory_utilization` of the device's
memory after that peak and after memory held outside torch's allocator (the CUDA context, other
processes). A fixed share of free memory, as before, left the first large batch to run out of
memory for its activations. On the CPU: a fifth of the available RAM, at most 1 GiB.

Two more claims on the device are counted before the cache gets the rest:
- CUDA graphs (captured after the cache is allocated) keep a private pool: the activations of the
  largest decode step, shared by every bucket, and each bucket's logits. The estimate scales the
  profiled activations to `cuda_graph_max_seqs` tokens and adds every bucket's float32 logits.
- Engines that share one device (`serve --replicas N` on fewer GPUs) each own `share` of it.
  Other processes' memory then is not an overhead to subtract from this engine's limit (the
  others' caches would make it negative); instead the engine takes `utilization x share x total`
  less its own peak, and never more than the device has free beyond the whole device's headroom
  (`1 - utilization`), so engines that profile at the same moment cannot overcommit it.
"""

from __future__ import annotations

import gc
import os
from typing import NamedTuple

import torch

from radixkv.model.loader import LoadedModel
from radixkv.scheduler.chunk import SequenceChunk


def kv_cache_budget(
    loaded: LoadedModel,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    gpu_memory_share: float = 1.0,
    cuda_graph_max_seqs: int = 0,
) -> int:
    """Bytes for the KV cache of `loaded` on its device (see the module docstring)."""
    device = loaded.device
    if device.type != "cuda":
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(available // 5, 1 << 30)
    weights = torch.cuda.memory_allocated(device)
    peak = profile_peak_memory(loaded, block_size, max_num_batched_tokens, max_model_len)
    graphs = graph_memory_estimate(
        max(peak - weights, 0), max_num_batched_tokens, cuda_graph_max_seqs, loaded.vocab_size
    )
    free, total = torch.cuda.mem_get_info(device)
    budget = cuda_budget(
        DeviceMemory(total, free, torch.cuda.memory_reserved(device)),
        peak + graphs,
        gpu_memory_utilization,
        gpu_memory_share,
    )
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: a step of {max_num_batched_tokens} tokens peaks at "
            f"{peak / 2**30:.2f} GiB (CUDA graphs {graphs / 2**30:.2f} GiB more) of the "
            f"{total * gpu_memory_utilization * gpu_memory_share / 2**30:.2f} GiB that "
            "gpu_memory_utilization allows; lower max_num_batched_tokens or raise gpu_memory_utilization"
        )
    return budget


class DeviceMemory(NamedTuple):
    """What the device reports after profiling: bytes in all, free, and reserved by this process's
    torch allocator."""

    total: int
    free: int
    reserved: int


def cuda_budget(memory: DeviceMemory, peak: int, utilization: float, share: float = 1.0) -> int:
    """The KV cache's bytes, given this engine's `peak` (weights, activations, graphs).

    Alone on the device (`share` 1): `utilization` of the device less the peak and less memory held
    outside this process's allocator (the CUDA context, other processes). Sharing it: its own
    `utilization x share` less its peak, capped by what is free beyond the device's headroom.
    """
    if share >= 1.0:
        outside_torch = max((memory.total - memory.free) - memory.reserved, 0)
        return int(memory.total * utilization) - peak - outside_torch
    own = int(memory.total * utilization * share) - peak
    headroom = memory.total - int(memory.total * utilization)
    return min(own, memory.free - headroom)


def graph_memory_estimate(
    activations: int, max_num_batched_tokens: int, cuda_graph_max_seqs: int, vocab_size: int
) -> int:
    """Bytes CUDA graphs keep for decode steps of up to `cuda_graph_max_seqs` sequences (0: none):
    the profiled step's `activations` scaled to that many tokens (one pool shared by every bucket),
    plus each bucket's float32 logits, which stay allocated as the graphs' outputs (small buckets
    also captured at narrower context widths add a few rows more)."""
    if cuda_graph_max_seqs <= 0:
        return 0
    from radixkv.model.cuda_graphs import graph_buckets  # imports the runner's modules

    scaled = activations * min(1.0, cuda_graph_max_seqs / max(max_num_batched_tokens, 1))
    return int(scaled) + sum(graph_buckets(cuda_graph_max_seqs)) * vocab_size * 4


def profile_peak_memory(
    loaded: LoadedModel, block_size: int, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """Peak bytes allocated by torch during one forward of `max_num_batched_tokens` prompt tokens."""
    from radixkv.model.runner import ModelRunner  # the runner imports this module's siblings

    device = loaded.device
    per_seq = max(1, max_model_len - 1)
    lengths = [per_seq] * (max_num_batched_tokens // per_seq)
    if max_num_batched_tokens % per_seq:
        lengths.append(max_num_batched_tokens % per_seq)
    blocks = [-(-n // block_size) for n in lengths]
    # An engine no longer referenced but held in reference cycles (a runner and its CUDA graphs)
    # still holds its KV cache until a collection: collect first, so that a second engine in the
    # process (replay --compare) does not count the first one's memory as its own peak.
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(loaded, sum(blocks), block_size)
    chunks, first = [], 0
    for n, b in zip(lengths, blocks, strict=True):
        chunks.append(SequenceChunk([0] * n, 0, list(range(first, first + b))))
        first += b
    runner.forward(chunks)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - runner.kv_cache.numel() * runner.kv_cache.element_size()
    del runner
    torch.cuda.empty_cache()
    return peak
