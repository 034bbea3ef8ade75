"""The fixed pool of physical KV blocks, with a reference count per block.

A block holds `block_size` consecutive token slots of every layer's K and V. Who references a
block: the radix cache (once, while the block is cached) and every live sequence whose block
table lists it (beams and parallel samples share blocks this way). A block with more than one
reference is never written in place: the writer takes a private copy first (copy-on-write).
"""

from __future__ import annotations

import re
from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """Not enough free blocks. The scheduler catches this to evict from the cache or preempt."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"need {needed} free KV blocks, only {free} free")
        self.needed = needed
        self.free = free


class BlockPool:
    """`num_blocks` physical blocks; allocate, share and free each in O(1).

    Free blocks sit on a stack, so the block freed last is reused first (its memory is warm).
    Freeing a block that is already free raises: it would hand one block to two owners.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        check_block_size(block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with one reference each; all of them or, raising OutOfBlocks, none."""
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        self.incref_all((block,))

    def decref(self, block: int) -> bool:
        """Drops one reference; returns True when that freed the block."""
        return self.decref_all((block,)) == 1

    def incref_all(self, blocks: Iterable[int]) -> None:
        """`incref` of every block in one call: a long prompt's match shares thousands at once."""
        refcount = self._refcount
        for b in blocks:
            if refcount[b] == 0:
                raise ValueError(f"block {b} is free; allocate it before sharing it")
            refcount[b] += 1

    def decref_all(self, blocks: Iterable[int]) -> int:
        """`decref` of every block in one call; returns how many that freed."""
        refcount, free = self._refcount, self._free
        freed = 0
        for b in blocks:
            count = refcount[b]
            if count == 0:
                raise ValueError(f"block {b} is already free")
            refcount[b] = count - 1
            if count == 1:
                free.append(b)
                freed += 1
        return freed

    def free_blocks(self) -> list[int]:
        return list(self._free)


def check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or not 1 <= block_size <= 128 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two from 1 to 128, got {block_size!r}")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(size: int | str, field: str = "kv_cache_memory", allow_zero: bool = False) -> int:
    """`512MiB`, `2 GiB`, `1.5GB` or a plain integer of bytes; errors name `field`."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        unit = m and m.group(2).lower()
        if not m or unit not in _UNITS:
            raise ValueError(f"{field} must be bytes or a size like '512MiB', got {size!r}")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{field} must be {'>= 0' if allow_zero else 'positive'}, got {size!r}")
    return value


def num_blocks_for_budget(budget: int | str, bytes_per_block: int, field: str = "kv_cache_memory") -> int:
    """`budget // bytes_per_block`, refusing a budget that holds no block at all."""
    budget_bytes = parse_bytes(budget, field)
    n = budget_bytes // bytes_per_block
    if n < 1:
        raise ValueError(f"{field} {budget!r} holds no KV block ({bytes_per_block} bytes per block)")
    return n
