"""Sequences' holds on KV blocks: admission through the prefix cache, growth, forks, release.

This is where the block pool and the radix cache meet the sequences that use them. A
`BlockTable` is one live sequence's hold: a reference on every block it lists and a lock on the
cached path it matched. Blocks are allocated on demand as the sequence grows; when the pool
runs dry the cache is evicted first, and only then `OutOfBlocks` reaches the scheduler, which
preempts. A block that more than one holder references is never written in place: the writer
gets a fresh block and a pending copy (copy-on-write) that the model runner executes before the
step's forward pass. Until then the copy keeps a reference on its source, so eviction or a
release in the same scheduling step can never hand the source to someone else too early. The
copies share one ordered queue with the host tier's offloads and loads (see `host_tier`).

Every live table is registered under its owner (a request id), so that a failed step can release
everything a request holds, even tables a half-done update created, and `check_invariants` can
tell a leaked table from a live one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from radixkv.cache.block_pool import BlockPool, OutOfBlocks
from radixkv.cache.host_tier import TransferKind, TransferQueue
from radixkv.cache.kv_groups import KVGroups, sliding_keep_from, valid_match_end
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.radix_tree import RadixNode
from radixkv.cache.salt import salt_offset, salted
from radixkv.errors import InvariantError

if TYPE_CHECKING:
    from radixkv.kvstore.store import StoredBlock, StoredRun


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


@dataclass(slots=True, eq=False)
class BlockTable:
    """`blocks[i]` holds positions `[i * block_size, (i + 1) * block_size)`; `num_tokens` slots
    are filled (or being filled this step). `node`, when set, is the locked cached path.
    `session`, when set, is the chat session the sequence belongs to: what it caches is tagged
    with it, for the `session` eviction policy. `key_offset` is its cache namespace
    (`radixkv.cache.salt`): the tokens it matches and caches are keyed shifted by it.
    `extra[g - 1]`: the table of KV group g >= 1 (`radixkv.cache.kv_groups`), as long as
    `blocks`; a sliding group's entries before its window are the manager's null block."""

    blocks: list[int]
    num_tokens: int = 0
    node: RadixNode | None = None
    owner: object = None  # the request holding it
    session: str | None = None
    num_loaded_tokens: int = 0  # of the tokens matched at admission, those loaded from the host
    num_stored_tokens: int = 0  # of the tokens matched at admission, those fetched from the KV store
    key_offset: int = 0
    extra: list[list[int]] = field(default_factory=list)


PREEMPTION_MODES = ("recompute", "swap")


class KVCacheManager:
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

    def admit(
        self,
        tokens: list[int],
        owner: object = None,
        session: str | None = None,
        stored: StoredRun | None = None,
        salt: str | None = None,
        max_match: int | None = None,
    ) -> BlockTable:
        """A table for a new sequence, holding the longest cached prefix of `tokens` but the
        last token, which is always computed so that its logits exist, and at most `max_match`
        tokens (positions whose logits are wanted are computed). A `session` is live from its
        first admission until `close_session`. `stored`: blocks of `tokens` fetched from the KV
        store (keyed as the cache keys them, salted); those that continue the tree's match join
        the tree (`load_stored`). `salt` (a request's `cache_salt`) limits what it matches and
        caches to its namespace."""
        offset = salt_offset(salt)
        def empty() -> BlockTable:
            extra = [[] for _ in self.windows]
            table = BlockTable([], owner=owner, session=session, key_offset=offset, extra=extra)
            return self._register(table)

        if self.cache is None:
            return empty()
        if session is not None:
            self.cache.set_session_live(session, True)
        limit = len(tokens) - 1 if max_match is None else min(len(tokens) - 1, max_match)
        if limit < 1:
            return empty()
        keys = salted(tokens[:limit], offset)
        match = self.cache.match_prefix(keys, session)
        if self.windows:
            end = self._valid_end(match.num_tokens, match.extra)
            if end < match.num_tokens:  # a sliding group lacks the window before the match's end
                match = self.cache.match_prefix(keys[:end], session)
        fetched = 0
        if stored is not None and stored.blocks:
            fetched = self.cache.load_stored(keys, match, stored, session)
            if fetched:
                match = self.cache.match_prefix(keys, session)
        self.cache.inc_lock(match.node)
        self.pool.incref_all(match.blocks)
        blocks, loaded = list(match.blocks), match.host_tokens
        extra = []
        for window, e in zip(self.windows, match.extra, strict=True):
            # a sliding group takes only its window: the entries before it stay null, so a
            # table's freed entries are always its leading ones (`release_windows`)
            keep = 0 if window is None else sliding_keep_from(match.num_tokens, window, self.block_size)
            extra.append([self.null_block] * keep + e[keep:])
            self.pool.incref_all(e[keep:])
            self.cache.touch_stale(e[keep:])
        table = BlockTable(
            blocks, match.num_tokens, match.node, owner, session, num_loaded_tokens=loaded,
            num_stored_tokens=fetched, key_offset=offset, extra=extra,
        )
        return self._register(table)

    def _valid_end(self, num_tokens: int, extra: tuple[list[int], ...]) -> int:
        """The longest prefix of a match of `num_tokens` tokens whose window every sliding group
        holds, `extra` being the groups' blocks along it."""
        end, last = num_tokens, -1
        while end != last:  # a cut for one group needs every other group's check again
            last = end
            for window, blocks in zip(self.windows, extra, strict=True):
                if window is not None:
                    end = valid_match_end(blocks, self.null_block, end, window, self.block_size)
        return end

    def keep_window(self, tokens: list[int], salt: str | None = None) -> None:
        """Makes the stale sliding-group blocks that a match of `tokens` (the next request to
        admit) reads the most recently used (`RadixCache.touch_stale`), so that what the running
        requests take meanwhile releases other stale blocks first and the request still hits
        its prefix when room comes; locks, touches and changes nothing else. No-op without KV
        groups."""
        if self.cache is None or not self.windows or len(tokens) < 2:
            return
        matched, extra = self.cache.peek_groups(salted(tokens[:-1], salt_offset(salt)))
        end = self._valid_end(matched, extra)
        for window, blocks in zip(self.windows, extra, strict=True):
            if window is not None:
                first = sliding_keep_from(end, window, self.block_size)
                self.cache.touch_stale(blocks[first : self.blocks_for(end)])

    def release_windows(self, table: BlockTable) -> None:
        """Releases the sliding groups' blocks of `table`, whose `num_tokens` are computed, that no
        token to come reads. `reserve` and `append_slot` call it first; a caller that counts
        `blocks_needed` against `num_available` may call it before, to count exactly. A table's
        null entries are its leading ones, so this walks back only over new ones."""
        null, num_tokens = self.null_block, table.num_tokens
        for window, blocks in zip(self.windows, table.extra, strict=True):
            if window is None:
                continue
            for i in range(sliding_keep_from(num_tokens, window, self.block_size) - 1, -1, -1):
                if blocks[i] == null:
                    break  # freed from the front: everything before is freed already
                self.pool.decref(blocks[i])
                blocks[i] = null

    def cached_prefix_len(self, tokens: list[int], salt: str | None = None) -> int:
        """How many leading tokens of `tokens` the cache holds in `salt`'s namespace (0 without a
        cache); changes nothing."""
        if self.cache is None:
            return 0
        return self.cache.cached_prefix_len(salted(tokens, salt_offset(salt)))

    def close_session(self, session: str) -> None:
        """The chat session has no more turns: its cached blocks lose their live-session rank."""
        if self.cache is not None:
            self.cache.set_session_live(session, False)

    def reserve(self, plan: list[tuple[BlockTable, int]]) -> None:
        """For each `(table, n)`, slots for `n` more tokens at positions `[table.num_tokens, ...)`:
        allocates the blocks they need and copies a shared block before it is written. All of
        it, or OutOfBlocks with nothing changed, so a request's sequences grow together."""
        B = self.block_size
        if self.windows:  # what left a window is released first, whatever else happens
            for table, _ in plan:
                self.release_windows(table)
        if len(plan) == 1:  # the usual decode: one sequence, its slots in its own last block
            table, n = plan[0]
            start = table.num_tokens
            own_block = start % B and self.pool.refcount(table.blocks[start // B]) == 1
            own_block = own_block and (not table.extra or self._owns(table, start // B))
            if own_block and start + n <= len(table.blocks) * B:
                table.num_tokens = start + n
                return
        self._ensure_free(self.blocks_needed(plan))
        for table, n in plan:
            start = table.num_tokens
            new = self.blocks_for(start + n) - len(table.blocks)
            for blocks in (table.blocks, *table.extra):
                if start % B and self.pool.refcount(blocks[start // B]) > 1:
                    (fresh,) = self.pool.allocate(1)
                    # The copy takes our reference on its source until it has run.
                    self.transfers.add(TransferKind.COPY, [blocks[start // B]], [fresh])
                    blocks[start // B] = fresh
                    self.num_cow_copies += 1
                blocks.extend(self.pool.allocate(new))
            table.num_tokens = start + n

    def _owns(self, table: BlockTable, i: int) -> bool:
        """Whether block `i` of every group of `table` has no other holder."""
        refcount = self.pool.refcount
        return refcount(table.blocks[i]) == 1 and all(refcount(e[i]) == 1 for e in table.extra)

    def append_slot(self, table: BlockTable) -> bool:
        """`reserve([(table, 1)])` in O(1), for the usual decode, where it needs no copy and no
        eviction: takes the slot after the table's last token, in its last block when nothing
        else references that block, else in a free block appended to the table, and returns
        True. Otherwise changes nothing (but release what left a sliding window) and returns
        False (then `reserve` decides). With KV groups, every group takes its slot alike."""
        start = table.num_tokens
        if table.extra:
            return self._append_slot_groups(table, start)
        if start % self.block_size:
            if self.pool.refcount(table.blocks[start // self.block_size]) != 1:
                return False
        elif self.pool.num_free:
            table.blocks += self.pool.allocate(1)
        else:
            return False
        table.num_tokens = start + 1
        return True

    def _append_slot_groups(self, table: BlockTable, start: int) -> bool:
        self.release_windows(table)
        if start % self.block_size:
            if not self._owns(table, start // self.block_size):
                return False
        elif self.pool.num_free > len(table.extra):
            for blocks in (table.blocks, *table.extra):
                blocks += self.pool.allocate(1)
        else:
            return False
        table.num_tokens = start + 1
        return True

    def blocks_needed(self, plan: list[tuple[BlockTable, int]]) -> int:
        """Fresh blocks `reserve(plan)` takes: new ones, and copies of shared blocks written."""
        need = 0
        for table, n in plan:
            start = table.num_tokens
            need += (self.blocks_for(start + n) - len(table.blocks)) * (1 + len(table.extra))
            if start % self.block_size:
                i = start // self.block_size
                need += self.pool.refcount(table.blocks[i]) > 1
                for e in table.extra:
                    need += self.pool.refcount(e[i]) > 1
        return need

    def fork(self, table: BlockTable) -> BlockTable:
        """A second holder of the same KV (a beam, a parallel sample): shares every block."""
        self.pool.incref_all(table.blocks)
        null = self.null_block
        for e in table.extra:
            self.pool.incref_all(b for b in e if b != null)
        if table.node is not None:
            self.cache.inc_lock(table.node)
        copy = BlockTable(
            list(table.blocks), table.num_tokens, table.node, table.owner, table.session,
            key_offset=table.key_offset, extra=[list(e) for e in table.extra],
        )
        return self._register(copy)

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

    def preempt(self, table: BlockTable, tokens: list[int], num_computed: int | None = None) -> None:
        """Caches and releases a preempted sequence's table; in `swap` mode also moves its
        computed KV to the host tier and pins it there for the owner (see `swap_in`).
        `num_computed` as in `cache_finished`."""
        computed = table.num_tokens if num_computed is None else num_computed
        owner, offset = table.owner, table.key_offset
        self.cache_finished(table, tokens, computed)
        if self.preemption_mode == "swap" and owner is not None and computed:
            node, moved = self.cache.swap_out(salted(tokens[:computed], offset))
            self.num_swapped_out_blocks += moved
            if node is not None:
                self._swapped.setdefault(owner, []).append(node)

    def swap_in(self, owner: object) -> None:
        """The owner was admitted again (its tables matched and loaded its swapped KV): the
        pins that kept that KV on the host are released."""
        for node in self._swapped.pop(owner, ()):
            self.cache.unpin(node)
        self.num_swapped_in_blocks += sum(
            self.blocks_for(t.num_loaded_tokens) for t in self._live.get(owner, ())
        )

    def drop_copies(self) -> None:
        """Forgets the pending copy-on-write copies (a failed step), dropping their source
        references. Offloads and loads stay queued: the tree already counts on them."""
        for t in self.transfers.drop(TransferKind.COPY):
            self.pool.decref_all(t.src)

    def num_live_tables(self) -> int:
        return sum(len(tables) for tables in self._live.values())

    def cache_finished(self, table: BlockTable, tokens: list[int], num_computed: int | None = None) -> None:
        """Caches the sequence's computed tokens (a finished or preempted sequence), then
        releases the table: its next turn, or its own resumption, finds them. `num_computed`
        (default: every slot of the table) leaves out slots a step in flight still computes."""
        computed = table.num_tokens if num_computed is None else num_computed
        if self.cache is not None and computed:
            keys = salted(tokens[:computed], table.key_offset)
            self.cache.insert(keys, table.blocks, table.session, table.extra)
        self.release(table)

    def cache_running(self, table: BlockTable, tokens: list[int], num_computed: int | None = None) -> None:
        """Caches the whole blocks of a sequence that keeps running, so that requests waiting
        on the same new prefix hit it now. The table moves its lock to the new path and swaps
        any duplicate block for the cache's own (freeing the duplicate). `num_computed` as in
        `cache_finished`."""
        if self.cache is None:
            return
        computed = table.num_tokens if num_computed is None else num_computed
        full = computed - computed % self.block_size
        locked = table.node.end if table.node is not None else 0
        if full <= locked:
            return
        keys = salted(tokens[:full], table.key_offset)
        self.cache.insert(keys, table.blocks, table.session, table.extra)
        match = self.cache.match_prefix(keys, table.session)
        self.cache.inc_lock(match.node)
        if table.node is not None:
            self.cache.dec_lock(table.node)
        table.node = match.node
        # Only the whole blocks of the locked path: where the insert declined a run (a hash
        # collision), the match ends early, perhaps inside a block of some other prefix.
        locked = match.node.end // self.block_size
        null = self.null_block
        for ours, cached in zip((table.blocks, *table.extra), (match.blocks, *match.extra), strict=True):
            for i, b in enumerate(cached[:locked]):
                if ours[i] != b and b != null and ours[i] != null:
                    self.pool.incref(b)
                    self.pool.decref(ours[i])
                    ours[i] = b

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

    def check_invariants(self, tables: Iterable[BlockTable]) -> None:
        """Every block is free or referenced, never both; each refcount equals the references
        held by the cache, the live tables and the pending copies; locks equal the tables'."""
        tables = list(tables)
        live = {id(t) for owned in self._live.values() for t in owned}
        if live != {id(t) for t in tables}:
            raise InvariantError("a live table is held by no sequence (leaked) or unregistered")
        refs: Counter[int] = Counter(src for src, _ in self.pending_copies)
        if self.windows:
            refs[self.null_block] += 1  # the manager's own hold on it
        locks: Counter[int] = Counter()
        for t in tables:
            if len(t.blocks) != self.blocks_for(t.num_tokens):
                raise InvariantError(f"{t} holds the wrong number of blocks")
            refs.update(t.blocks)
            self._check_groups(t, refs)
            node = t.node
            while node is not None and node.parent is not None:
                locks[node.id] += 1
                node = node.parent
        pins = Counter(n.id for nodes in self._swapped.values() for n in nodes)
        if self.cache is not None:
            self.cache.check_invariants()
            refs.update(self.cache.referenced_blocks())
            for node in self.cache.nodes():
                if node is not self.cache.root:
                    if node.lock_ref != locks[node.id]:
                        raise InvariantError(f"{node} lock_ref, tables hold {locks[node.id]}")
                    if node.host_pin != pins[node.id]:
                        raise InvariantError(f"{node} host_pin, swapped holds {pins[node.id]}")
        free = self.pool.free_blocks()
        if len(set(free)) != len(free):
            raise InvariantError("a block is on the free list twice")
        for b in range(self.pool.num_blocks):
            count = self.pool.refcount(b)
            if count != refs[b]:
                raise InvariantError(f"block {b}: refcount {count}, but {refs[b]} references are held")
        if set(free) != {b for b in range(self.pool.num_blocks) if refs[b] == 0}:
            raise InvariantError("free list is wrong")
        host = self.cache.host if self.cache is not None else None
        if host is not None:
            held = Counter(self.cache.referenced_host_blocks())
            host_free = host.pool.free_blocks()
            if len(set(host_free)) != len(host_free):
                raise InvariantError("a host block is on the free list twice")
            for b in range(host.pool.num_blocks):
                count = host.pool.refcount(b)
                if count != held[b]:
                    raise InvariantError(f"host block {b}: refcount {count}, but {held[b]} nodes hold it")
            if set(host_free) != {b for b in range(host.pool.num_blocks) if not held[b]}:
                raise InvariantError("host free list is wrong")

    def _check_groups(self, t: BlockTable, refs: Counter[int]) -> None:
        """Every group's table is as long as group 0's and holds every block its window needs."""
        if len(t.extra) != len(self.windows):
            raise InvariantError(f"{t} has {len(t.extra)} group tables, the model {len(self.windows)}")
        for window, e in zip(self.windows, t.extra, strict=True):
            if len(e) != len(t.blocks):
                raise InvariantError(f"{t}: a group table of {len(e)} blocks, group 0's {len(t.blocks)}")
            keep = 0 if window is None else sliding_keep_from(t.num_tokens, window, self.block_size)
            if self.null_block in e[keep:]:
                raise InvariantError(f"{t} released a block inside its window of {window} tokens")
            if self.null_block in t.blocks:
                raise InvariantError(f"{t} lists the null block in group 0")
            refs.update(b for b in e if b != self.null_block)

    def _register(self, table: BlockTable) -> BlockTable:
        self._live.setdefault(table.owner, set()).add(table)
        return table

    def _ensure_free(self, n: int) -> None:
        if n > self.pool.num_free and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        if n > self.pool.num_free:
            raise OutOfBlocks(n, self.pool.num_free)
