"""Sequences' holds on KV blocks: admission through the prefix cache, growth, forks, release.

This is where the block pool and the radix cache meet the sequences that use them. A
`BlockTable` (`block_table`) is one live sequence's hold: a reference on every block it lists
and a lock on the cached path it matched. `KVCacheManager` is one object made of one room per
concern:

- `kv_prefix`: admission's match, the inserts of running and finished sequences, the looks at
  what is cached;
- `kv_growth`: blocks allocated on demand (evicting the cache first, and only then
  `OutOfBlocks` reaching the scheduler, which preempts), copy-on-write, forks, sliding windows'
  releases;
- `kv_preemption`: what a preempted sequence's KV becomes (`recompute` or `swap`);
- `kv_invariants`: `check_invariants`, the recount of all of it.

This module holds the state they share, releases, the ordered block transfers and what moves
their data (`BlockMover`): copy-on-write copies share one queue with the host tier's offloads
and loads (see `host_tier`), and the meters of what is available and used.

Every live table is registered under its owner (a request id), so that a failed step can release
everything a request holds, even tables a half-done update created, and `check_invariants` can
tell a leaked table from a live one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.block_table import BlockTable
from radixkv.cache.host_tier import TransferKind, TransferQueue
from radixkv.cache.kv_groups import KVGroups
from radixkv.cache.kv_growth import KVGrowth
from radixkv.cache.kv_invariants import KVInvariants
from radixkv.cache.kv_preemption import KVPreemption
from radixkv.cache.kv_prefix import KVPrefix
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.radix_tree import RadixNode

if TYPE_CHECKING:
    from radixkv.kvstore.store import StoredBlock


class BlockMover(Protocol):
    """Moves KV data between blocks; the model runner is one, and `simulate` passes `NO_DATA`.
    Each call's pairs may be copied in parallel: their destinations are distinct."""

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copies whole device blocks `src[i] -> dst[i]` (none of `dst` is in `src`)."""

    def offload(self, src: list[int], dst: list[int]) -> None:
        """Copies device blocks `src[i]` to host blocks `dst[i]`."""

    def load(self, src: list[int], dst: list[int]) -> None:
        """Copies host blocks `src[i]` to device blocks `dst[i]`. It must read the host blocks
        before it returns; it may write the device blocks later, as long as every later call
        and the next forward pass see them written (the model runner writes them layer by
        layer in that forward)."""

    def save(self, src: list[int], keys: list[bytes]) -> None:
        """Copies device blocks `src[i]` off the device and queues them for the KV store under
        `keys[i]` (or drops them, counted, when the store's write queue is full)."""

    def fetch(self, src: list[StoredBlock], dst: list[int]) -> None:
        """Writes blocks fetched from the KV store into device blocks `dst[i]`, with the timing
        of `load`."""


class _NoData:
    """A mover for the cache's books alone, where blocks hold no data (`radixkv simulate`)."""

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        pass

    def offload(self, src: list[int], dst: list[int]) -> None:
        pass

    def load(self, src: list[int], dst: list[int]) -> None:
        pass

    def save(self, src: list[int], keys: list[bytes]) -> None:
        pass

    def fetch(self, src: list[StoredBlock], dst: list[int]) -> None:
        pass


NO_DATA: BlockMover = _NoData()

PREEMPTION_MODES = ("recompute", "swap")


class KVCacheManager(KVPrefix, KVGrowth, KVPreemption, KVInvariants):
    """`preemption_mode`: what a preempted sequence's KV becomes. `recompute`: it is cached in
    the tree like a finished sequence's, and whatever eviction leaves of it is a hit on
    resumption. `swap` (needs a host tier): it is cached, moved to the host tier at once, and
    pinned there until the request is admitted again, so resumption loads all of it and
    recomputes nothing.

    `groups` (`radixkv.cache.kv_groups`), when it has more than one group: every table keeps one
    block list per group, all from `pool`; a sliding group's blocks that left the window of every
    token still to come are released (their entries become `null_block`, a block the manager
    holds for ever and no kernel reads), and a cache match is cut to the longest prefix whose
    window every sliding group still holds."""

    def __init__(
        self,
        pool: BlockPool,
        cache: RadixCache | None,
        preemption_mode: str = "recompute",
        groups: KVGroups | None = None,
    ) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and (cache is None or cache.host is None):
            raise ValueError("preemption_mode 'swap' needs a host tier (host_kv_cache_memory > 0)")
        self.preemption_mode = preemption_mode
        self.pool = pool
        self.cache = cache
        self.block_size = pool.block_size
        self.transfers = cache.transfers if cache is not None else TransferQueue()
        self.num_cow_copies = 0
        self._live: dict[object, set[BlockTable]] = {}  # owner -> its live tables
        self._swapped: dict[object, list[RadixNode]] = {}  # owner -> locked paths of its swapped KV
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        # groups 1..: their windows (None: a second global group), and the null block
        self.windows: tuple[int | None, ...] = groups.windows[1:] if groups is not None else ()
        self.null_block = -1
        if self.windows:
            if preemption_mode == "swap":
                raise ValueError("preemption_mode 'swap' is not supported with sliding-window KV groups")
            (self.null_block,) = pool.allocate(1)
            if cache is not None:
                cache.set_groups(self.windows, self.null_block)

    @property
    def num_available(self) -> int:
        """Blocks that allocation plus eviction can deliver now, exactly: the free ones, and the
        evictable cached ones that nothing else references. A cached block of an unlocked node
        can still be referenced beyond the locked path of a live table (a partly matched last
        block, a fork's shared tail) or by a pending copy; evicting it frees nothing. Stale
        group blocks (`RadixCache.stale`) count as evictable, locked or not."""
        if self.cache is None:
            return self.pool.num_free
        evictable = self.cache.evictable_block
        pinned = {src for src, _ in self.pending_copies if evictable(src)}
        for tables in self._live.values():
            for t in tables:
                locked = t.node.end // self.block_size if t.node is not None else 0
                pinned.update(b for b in t.blocks[locked:] if evictable(b))
                for blocks in t.extra:  # a stale group block may lie inside the locked path too
                    pinned.update(b for b in blocks if evictable(b))
        return self.pool.num_free + self.cache.evictable_size + len(self.cache.stale) - len(pinned)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def release(self, table: BlockTable) -> None:
        self.pool.decref_all(table.blocks)
        if table.extra:
            null = self.null_block
            for e in table.extra:
                self.pool.decref_all(b for b in e if b != null)
            table.extra = [[] for _ in self.windows]
        if table.node is not None:
            self.cache.dec_lock(table.node)
        table.blocks, table.num_tokens, table.node = [], 0, None
        owned = self._live.get(table.owner)
        if owned is not None:
            owned.discard(table)
            if not owned:
                del self._live[table.owner]

    def release_owner(self, owner: object) -> None:
        """Releases every live table of `owner`, uncached: what a failed step left behind; and
        the locks on its swapped-out KV."""
        for table in list(self._live.get(owner, ())):
            self.release(table)
        for node in self._swapped.pop(owner, ()):
            self.cache.unpin(node)

    def drop_copies(self) -> None:
        """Forgets the pending copy-on-write copies (a failed step), dropping their source
        references. Offloads and loads stay queued: the tree already counts on them."""
        for t in self.transfers.drop(TransferKind.COPY):
            self.pool.decref_all(t.src)

    def num_live_tables(self) -> int:
        return sum(len(tables) for tables in self._live.values())

    def run_transfers(self, mover: BlockMover) -> None:
        """Executes the step's pending block transfers through `mover`, in order, then drops the
        references they held. The engine calls it before every forward pass and `simulate`
        after every request (with `NO_DATA`), so both release blocks through the same path.

        A transfer leaves the queue only once the mover took it (a load may complete during
        the forward: see `BlockMover.load`; a copy-on-write copy of a block loaded in the same
        step then completes with it, so its source reference is dropped once the mover took
        it, as for any copy: the mover holds the order from there). When the mover raises, the
        failed one and those after it stay queued: the failed step drops its copies
        (`drop_copies`, which releases their sources), and the offloads and loads the tree
        already counts on run before the next forward."""
        queue = self.transfers
        while queue.pending:
            t = queue.pending[0]
            if t.kind is TransferKind.COPY:
                mover.copy_blocks(t.src, t.dst)
            elif t.kind is TransferKind.OFFLOAD:
                mover.offload(t.src, t.dst)
            elif t.kind is TransferKind.LOAD:
                mover.load(t.src, t.dst)
            elif t.kind is TransferKind.SAVE:
                mover.save(t.src, t.dst)
            else:
                mover.fetch(t.src, t.dst)
            queue.pop_first()
            if t.kind is TransferKind.COPY:
                self.pool.decref_all(t.src)

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies queued for the next `run_transfers`, as (source, fresh)."""
        return self.transfers.of_kind(TransferKind.COPY)

    def slot_usage(self, tables: Iterable[BlockTable]) -> tuple[int, int]:
        """(token slots holding KV, token slots in blocks in use), with no copies pending. A block
        several holders share counts once, at its fullest.

        O(tables + partly filled cached blocks), whatever the number of blocks: every block in
        use is full but the last block of a table or of a cached node. The cache keeps its partly
        filled blocks up to date (`RadixCache.partial_blocks`). A holder of a partly filled block
        that is neither the cache nor a table ending in it holds it whole: another table that
        wrote past it (copy-on-write keeps the shared slots equal), or the cache, when a match
        ended inside one of its blocks. Without copies pending, every reference is one of these.
        """
        B = self.block_size
        partial = self.cache.partial_blocks if self.cache is not None else {}
        fill: dict[int, int] = {}  # a table's partly filled last block -> its fullest such holder
        holders: dict[int, int] = {}
        for table in tables:
            if table.num_tokens % B:
                for blocks in (table.blocks, *table.extra):  # every group's last block
                    last = blocks[-1]
                    fill[last] = max(fill.get(last, 0), table.num_tokens % B)
                    holders[last] = holders.get(last, 0) + 1
        empty = 0
        for block, filled in partial.items():
            if self.pool.refcount(block) == 1 + holders.get(block, 0):
                empty += B - max(filled, fill.get(block, 0))
        for block, filled in fill.items():
            if block not in partial and self.pool.refcount(block) == holders[block]:
                empty += B - filled
        slots = (self.pool.num_blocks - self.pool.num_free - (self.null_block >= 0)) * B  # not the null block
        return slots - empty, slots

    def _register(self, table: BlockTable) -> BlockTable:
        self._live.setdefault(table.owner, set()).add(table)
        return table
