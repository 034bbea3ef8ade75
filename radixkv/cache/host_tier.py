"""The host tier's books: a second block pool behind the device, and the ordered queue of block
transfers the model runner executes before each forward pass.

Blocks the device cache evicts are written to host blocks (write-back) instead of dropped, and
stay in the radix tree; a match that reaches them loads them back into fresh device blocks and
frees their host copy, so the two tiers hold distinct blocks and their capacities add up (on the
Mooncake trace, 4,000 device + 16,000 host blocks find 0.571 of prompt tokens, one tier of
20,000 0.572; keeping the host copies found 0.549). With `write_through` a node gets its host
copy as soon as it is cached and keeps it, so device eviction never waits on a copy. The host
pool evicts by its own policy, whole nodes at a time.

Transfers are executed in the order they were queued, and every transfer is queued when its
source holds the data it copies: a device block freed by eviction can be handed out again at
once, because the offload that reads it runs before anything queued later writes it, and the
forward pass writes a layer only after that layer's transfers have run. (The model runner may
write a load's device blocks later than it is called, layer by layer during the forward, but
keeps this order: see `radixkv.model.layered_load`.) Consecutive transfers of one kind are
merged into one batched call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.eviction import LFU, LRU, EvictionPolicy


class TransferKind(enum.Enum):
    COPY = "copy"  # device -> device (copy-on-write)
    OFFLOAD = "offload"  # device -> host
    LOAD = "load"  # host -> device
    SAVE = "save"  # device -> the KV store (src: device blocks, dst: the blocks' store keys)
    FETCH = "fetch"  # the KV store -> device (src: fetched `StoredBlock`s, dst: device blocks)


@dataclass(slots=True)
class Transfer:
    """Copies `src[i] -> dst[i]` for every i, all of one kind, in parallel: no destination is
    written twice, and (device to device) none is also a source. Block ids, but for the store's
    kinds, whose keys and fetched blocks stand in for blocks of the store."""

    kind: TransferKind
    src: list[Any]
    dst: list[Any]


@dataclass(slots=True)
class TransferQueue:
    pending: list[Transfer] = field(default_factory=list)
    _read: set[int] = field(default_factory=set)  # sources of the last batch
    _written: set[int] = field(default_factory=set)  # destinations of the last batch

    def add(self, kind: TransferKind, src: list[Any], dst: list[Any]) -> None:
        """Queues copies after everything queued so far. They join the last batch when it is of
        the same kind and copying them in parallel with it reads and writes the same data."""
        last = self.pending[-1] if self.pending else None
        clash = last is None or last.kind is not kind
        clash = clash or any(b in self._written for b in (*src, *dst))
        clash = clash or (kind is TransferKind.COPY and any(b in self._read for b in dst))
        if clash:
            last = Transfer(kind, [], [])
            self.pending.append(last)
            self._read, self._written = set(), set()
        last.src.extend(src)
        last.dst.extend(dst)
        self._read.update(src)
        self._written.update(dst)

    def pop_first(self) -> None:
        """Takes the first pending transfer out of the queue (it has run)."""
        self.pending.pop(0)
        if not self.pending:
            self._read, self._written = set(), set()

    def drop(self, kind: TransferKind) -> list[Transfer]:
        """Takes every pending transfer of `kind` out of the queue; returns them."""
        dropped = [t for t in self.pending if t.kind is kind]
        self.pending = [t for t in self.pending if t.kind is not kind]
        last = self.pending[-1] if self.pending else Transfer(kind, [], [])
        self._read, self._written = set(last.src), set(last.dst)
        return dropped

    def of_kind(self, kind: TransferKind) -> list[tuple[int, int]]:
        return [(s, d) for t in self.pending if t.kind is kind for s, d in zip(t.src, t.dst, strict=True)]


HOST_POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU)}


class HostTier:
    """`num_blocks` host blocks of the device's block size, evicted by `eviction` (`lru` or
    `lfu`: policies that keep no state on the nodes, which the device policy owns)."""

    def __init__(self, num_blocks: int, block_size: int, eviction: str = "lru", write_through: bool = False):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"host_blocks must be a positive number of blocks, got {num_blocks!r}")
        if eviction not in HOST_POLICIES:
            raise ValueError(f"host eviction must be one of {sorted(HOST_POLICIES)}, got {eviction!r}")
        self.pool = BlockPool(num_blocks, block_size)
        self.policy = HOST_POLICIES[eviction]()
        self.write_through = write_through
        self.num_offloaded = 0  # blocks written device -> host
        self.num_loaded = 0  # blocks read host -> device
        self.num_evicted = 0  # host blocks dropped
