"""The host tier's KV tensor: the same layout as the device cache (`[2, layers, blocks, ...]`, K
then V) in host memory, and the batched copies between the two.

On CUDA the host tensor is pinned, so the copies are DMA transfers queued on the current stream:
an offload before a load of the same host block, and both before the step's forward, run in that
order without a host-side wait. On a CPU the "device" cache is host memory too and the copies are
plain gathers and scatters. Each call copies all of its block pairs, in every layer and both of K
and V, with one gather and one scatter along the block dimension.
"""

from __future__ import annotations

import torch

BLOCK_DIM = 2  # [K/V, layer, block, slot, head, dim]


class HostKVCache:
    def __init__(self, num_blocks: int, like: torch.Tensor) -> None:
        """`num_blocks` host blocks shaped like the blocks of the device cache `like`."""
        if num_blocks < 1:
            raise ValueError(f"host num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.device = like.device
        shape = (*like.shape[:BLOCK_DIM], num_blocks, *like.shape[BLOCK_DIM + 1 :])
        self.tensor = torch.zeros(shape, dtype=like.dtype, pin_memory=self.device.type == "cuda")

    @torch.inference_mode()
    def offload(self, device_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Device blocks `src[i]` -> host blocks `dst[i]`, in every layer."""
        if not src:
            return
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        rows = device_cache.index_select(BLOCK_DIM, src_t).to("cpu")
        self.tensor.index_copy_(BLOCK_DIM, torch.tensor(dst, dtype=torch.long), rows)

    @torch.inference_mode()
    def load(self, device_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Host blocks `src[i]` -> device blocks `dst[i]`, in every layer."""
        if not src:
            return
        rows = self.tensor.index_select(BLOCK_DIM, torch.tensor(src, dtype=torch.long))
        pin = self.device.type == "cuda"
        if pin:
            rows = rows.pin_memory()
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        device_cache.index_copy_(BLOCK_DIM, dst_t, rows.to(self.device, non_blocking=pin))
