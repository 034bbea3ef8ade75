"""How many bytes the KV cache gets when the user sets none.

On CUDA, as vLLM sizes it: run one forward at the largest step the scheduler can make
(`max_num_batched_tokens` new tokens, in sequences of at most `max_model_len - 1`) through a
runner holding just the blocks it needs, and read the allocator's peak: weights plus the
activations of that step. The cache gets what remains of `gpu_memory_utilization` of the device's
memory after that peak and after memory held outside torch's allocator (the CUDA context, other
processes). A fixed share of free memory, as before, left the first large batch to run out of
memory for its activations. On the CPU: a fifth of the available RAM, at most 1 GiB.
"""

from __future__ import annotations

import gc
import os

import torch

from radixkv.model.loader import LoadedModel


def kv_cache_budget(
    loaded: LoadedModel,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    gpu_memory_utilization: float,
) -> int:
    """Bytes for the KV cache of `loaded` on its device (see the module docstring)."""
    device = loaded.device
    if device.type != "cuda":
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(available // 5, 1 << 30)
    peak = profile_peak_memory(loaded, block_size, max_num_batched_tokens, max_model_len)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = int(total * gpu_memory_utilization) - peak - max(outside_torch, 0)
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: a step of {max_num_batched_tokens} tokens peaks at "
            f"{peak / 2**30:.2f} GiB of the {total * gpu_memory_utilization / 2**30:.2f} GiB that "
            "gpu_memory_utilization allows; lower max_num_batched_tokens or raise gpu_memory_utilization"
        )
    return budget


def profile_peak_memory(
    loaded: LoadedModel, block_size: int, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """Peak bytes allocated by torch during one forward of `max_num_batched_tokens` prompt tokens."""
    from radixkv.model.runner import ModelRunner, SequenceChunk  # the runner imports this module's siblings

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
