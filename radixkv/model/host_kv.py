"""The host tier's KV tensors: one K and one V tensor per layer in host memory, the same layout
as the device cache, and the batched copies between the two.

On CUDA the host tensors are pinned, so the copies are DMA transfers queued on the current
stream: an offload before a load of the same host block, and both before the step's forward,
run in that order without a host-side wait. On a CPU the "device" cache is host memory too and
the copies are plain gathers and scatters. Each call copies all of its block pairs in every
layer at once (one gather and one scatter per layer and direction).
"""

from __future__ import annotations

import torch


class HostKVCache:
    def __init__(self, num_blocks: int, like: list[torch.Tensor]) -> None:
        """`num_blocks` host blocks for each of the device caches `like` (one per layer, K and V
        lists concatenated)."""
        if num_blocks < 1:
            raise ValueError(f"host num_blocks must be >= 1, got {num_blocks}")
        device = like[0].device
        pin = device.type == "cuda"
        self.num_blocks = num_blocks
        self.device = device
        self.tensors = [
            torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in like
        ]

    @torch.inference_mode()
    def offload(self, device_caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        """Device blocks `src[i]` -> host blocks `dst[i]`, in every layer."""
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long)
        for cache, host in zip(device_caches, self.tensors, strict=True):
            host.index_copy_(0, dst_t, cache.index_select(0, src_t).to("cpu"))

    @torch.inference_mode()
    def load(self, device_caches: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        """Host blocks `src[i]` -> device blocks `dst[i]`, in every layer."""
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.long)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        for cache, host in zip(device_caches, self.tensors, strict=True):
            rows = host.index_select(0, src_t)
            if pin:
                rows = rows.pin_memory()
            cache.index_copy_(0, dst_t, rows.to(self.device, non_blocking=pin))
