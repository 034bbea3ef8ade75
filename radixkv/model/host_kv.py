"""The host tier's KV tensor: the same layout as the device cache (`[2, layers, blocks, ...]`, K
then V) in host memory, and the reads and writes of its blocks.

On CUDA the host tensor is pinned. An offload moves its blocks `OFFLOAD_CHUNK_BLOCKS` at a time:
it gathers them on the device on the current stream, copies them into a pinned staging buffer
with a synchronising copy (so everything queued before it on that stream, the loads it waited
for among them, has finished) and writes them into the host tensor. Gathering a whole eviction
at once took device memory the KV budget never counted (1 GiB for 512 blocks of an 8B model) and
copied it into pageable memory, at half the bandwidth of pinned.
A load is staged here (`stage`) and written into the device cache layer by layer during the
forward pass (`radixkv.model.layered_load`). On a CPU the "device" cache is host memory too and
both are plain gathers and scatters along the block dimension.
"""

from __future__ import annotations

import torch

BLOCK_DIM = 2  # [K/V, layer, block, slot, head, dim]
OFFLOAD_CHUNK_BLOCKS = 32
"""Blocks an offload moves at a time: its device gather and pinned staging hold at most this many
(64 MiB for an 8B model's 2 MiB blocks)."""


class HostKVCache:
    def __init__(self, num_blocks: int, like: torch.Tensor) -> None:
        """`num_blocks` host blocks shaped like the blocks of the device cache `like`."""
        if num_blocks < 1:
            raise ValueError(f"host num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.device = like.device
        self.pin = self.device.type == "cuda"
        shape = (*like.shape[:BLOCK_DIM], num_blocks, *like.shape[BLOCK_DIM + 1 :])
        self.tensor = torch.zeros(shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
        # Flat, so that a chunk's rows are a contiguous view of its start (pinned to pinned copy).
        per_block = self.tensor[:, :, 0].numel()
        self._staging = (
            torch.empty(
                min(num_blocks, OFFLOAD_CHUNK_BLOCKS) * per_block,
                dtype=like.dtype,
                device="cpu",
                pin_memory=True,
            )
            if self.device.type != "cpu"
            else None
        )  # on a CPU the gather is already in host memory

    @torch.inference_mode()
    def offload(self, device_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Device blocks `src[i]` -> host blocks `dst[i]`, in every layer, a chunk at a time."""
        for start in range(0, len(src), OFFLOAD_CHUNK_BLOCKS):
            end = start + OFFLOAD_CHUNK_BLOCKS
            rows = device_cache.index_select(BLOCK_DIM, torch.tensor(src[start:end], device=self.device))
            if self._staging is not None:
                rows = self._staging[: rows.numel()].view(rows.shape).copy_(rows)
            self.tensor.index_copy_(BLOCK_DIM, torch.tensor(dst[start:end]), rows)

    @torch.inference_mode()
    def stage(self, src: list[int]) -> torch.Tensor:
        """A copy of host blocks `src`, layer-major (`[layers, 2, len(src), ...]`, so each layer's
        rows are contiguous for one host-to-device copy), pinned on CUDA. Read now: the host
        blocks may be overwritten as soon as this returns."""
        kv, layers = self.tensor.shape[:BLOCK_DIM]
        shape = (layers, kv, len(src), *self.tensor.shape[BLOCK_DIM + 1 :])
        rows = torch.empty(shape, dtype=self.tensor.dtype, device="cpu", pin_memory=self.pin)
        ids = torch.tensor(src, dtype=torch.long, device="cpu")
        # One gather per layer and K/V, along the leading dimension of a contiguous slice: one
        # index_select along the block dimension of the whole tensor took 20x as long (1,217 ms
        # against 58 ms for 256 MiB of bfloat16 on this machine's CPU).
        for layer in range(layers):
            for k_or_v in range(kv):
                torch.index_select(self.tensor[k_or_v, layer], 0, ids, out=rows[layer, k_or_v])
        return rows
