"""What a KV block's memory holds: K and V at the model's dtype, or quantized beside their scales.

`kv_cache_dtype` `auto` keeps the cache `[2, layers, blocks, block_size, Hkv, D]` in the model's
dtype. `int8` and `fp8_e4m3` store each element in one byte and each token's head with its own
scale (max|x| / 127 or / 448, computed by `store_kv` as the token is written: no calibration),
itself one byte: a code of radixkv.kernels.scale_code, rounded up so that nothing is clipped. A
quantized block of one layer is one row of bytes, the K (or V) values of its slots first, then
their scale codes, each part starting on a 16-byte boundary:

    [slot 0 head 0: D bytes][slot 0 head 1] ... [pad] [code (slot 0, head 0): 1 byte] ... [pad]

shaped `[1, 1, row_bytes]`, so that the cache keeps the six dimensions (`[2, layers, blocks, ...]`)
that everything moving blocks indexes: copy-on-write, the host tier, swap, layered loads and the KV
store move a block's bytes and so its scales with it, and their bytes per block shrink with it.
The kernels see strided views: values `[blocks, block_size, Hkv, D]` and scale codes
`[blocks, block_size, Hkv]` over the same memory.

A token's head is D + 1 bytes: at D = 32 (the tiny presets) 33 against 64 in bfloat16 (1.94x the
blocks in the same memory) and 128 in float32 (3.88x); at D = 128, 1.98x and 3.97x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixkv.kernels.scale_code import SCALE_CODE_DTYPE

_STORED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
ALIGN = 16  # bytes: each part of a row starts where a GPU's vector loads can read it


def check_fp8_device(device: str) -> None:
    """ValueError unless `device` stores float8_e4m3fn: CUDA of compute capability 8.9 or later
    (Ada, Hopper and on), where the conversions are in hardware."""
    capability = torch.cuda.get_device_capability(device) if device.startswith("cuda") else None
    if capability is None or capability < (8, 9):
        have = f"compute capability {capability[0]}.{capability[1]}" if capability else f"device {device!r}"
        raise ValueError(
            f"kv_cache_dtype 'fp8_e4m3' needs a CUDA device of compute capability 8.9 or later; this "
            f"engine runs on {have}. Use kv_cache_dtype 'int8' (any device) or 'auto'."
        )


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The layout of a cache of `block_size` slots of `num_kv_heads` x `head_dim` per block and layer."""

    kv_cache_dtype: str
    dtype: torch.dtype  # the model's: what `auto` stores
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def _values_bytes(self) -> int:
        return _round_up(self.block_size * self.num_kv_heads * self.head_dim, ALIGN)

    @property
    def _scales_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * SCALE_CODE_DTYPE.itemsize

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of one layer's K (or V): the cache's dimensions after the block's."""
        if not self.quantized:
            return (self.block_size, self.num_kv_heads, self.head_dim)
        return (1, 1, self._values_bytes + _round_up(self._scales_bytes, ALIGN))

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    def block_bytes(self, num_layers: int) -> int:
        """Bytes of one block: K and V of `num_layers` layers."""
        row = self.block_shape[0] * self.block_shape[1] * self.block_shape[2]
        return 2 * num_layers * row * self.storage_dtype.itemsize

    def allocate(self, num_layers: int, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        """A zeroed cache `[2, num_layers, num_blocks, *block_shape]` (scale codes 0: no slot stored)."""
        shape = (2, num_layers, num_blocks, *self.block_shape)
        return torch.zeros(shape, dtype=self.storage_dtype, device=device)

    def views(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer's K (or V) cache `[blocks, *block_shape]` as the kernels read it: values
        `[blocks, block_size, Hkv, D]` and, quantized, scales `[blocks, block_size, Hkv]` (else None)."""
        if not self.quantized:
            return layer_cache, None
        rows = layer_cache.flatten(1)
        shape = (rows.shape[0], self.block_size, self.num_kv_heads)
        values = rows[:, : self.block_size * self.num_kv_heads * self.head_dim]
        values = values.view(_STORED[self.kv_cache_dtype])
        scales = rows[:, self._values_bytes : self._values_bytes + self._scales_bytes].view(SCALE_CODE_DTYPE)
        return values.view(*shape, self.head_dim), scales.view(shape)
