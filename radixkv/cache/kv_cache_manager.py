"""Sequences' holds on KV blocks: admission through the prefix cache, growth, forks, release.

This is where the block pool and the radix cache meet the sequences that use them. A
`BlockTable` is one live sequence's hold: a reference on every block it lists and a lock on the
cached path it matched. Blocks are allocated on demand as the sequence grows; when the pool
runs dry the cache is evicted first, and only then `OutOfBlocks` reaches the scheduler, which
preempts. A block that more than one holder references is never written in place: the writer
gets a fresh block and a pending copy (copy-on-write) that the model runner executes before the
step's forward pass. Until then the copy keeps a reference on its source, so eviction or a
release in the same scheduling step can never hand the source to someone else too early.

Every live table is registered under its owner (a request id), so that a failed step can release
everything a request holds, even tables a half-done update created, and `check_invariants` can
tell a leaked table from a live one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from radixkv.cache.block_pool import BlockPool, OutOfBlocks
from radixkv.cache.radix_cache import RadixCache, RadixNode


@dataclass(slots=True, eq=False)
class BlockTable:
    """`blocks[i]` holds positions `[i * block_size, (i + 1) * block_size)`; `num_tokens` slots
    are filled (or being filled this step). `node`, when set, is the locked cached path."""

    blocks: list[int]
    num_tokens: int = 0
    node: RadixNode | None = None
    owner: object = None  # the request holding it


class KVCacheManager:
    def __init__(self, pool: BlockPool, cache: RadixCache | None) -> None:
        self.pool = pool
        self.cache = cache
        self.block_size = pool.block_size
        self.pending_copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0
        self._live: dict[object, set[BlockTable]] = {}  # owner -> its live tables

    @property
    def num_available(self) -> int:
        """Blocks that allocation plus eviction can deliver now, exactly: the free ones, and the
        evictable cached ones that nothing else references. A cached block of an unlocked node
        can still be referenced beyond the locked path of a live table (a partly matched last
        block, a fork's shared tail) or by a pending copy; evicting it frees nothing."""
        if self.cache is None:
            return self.pool.num_free
        evictable = self.cache.evictable_block
        pinned = {src for src, _ in self.pending_copies if evictable(src)}
        for tables in self._live.values():
            for t in tables:
                locked = t.node.end // self.block_size if t.node is not None else 0
                pinned.update(b for b in t.blocks[locked:] if evictable(b))
        return self.pool.num_free + self.cache.evictable_size - len(pinned)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, tokens: list[int], owner: object = None) -> BlockTable:
        """A table for a new sequence, holding the longest cached prefix of `tokens` but the
        last token, which is always computed so that its logits exist."""
        if self.cache is None or len(tokens) < 2:
            return self._register(BlockTable([], owner=owner))
        match = self.cache.match_prefix(tokens[:-1])
        self.cache.inc_lock(match.node)
        for b in match.blocks:
            self.pool.incref(b)
        return self._register(BlockTable(list(match.blocks), match.num_tokens, match.node, owner))

    def reserve(self, plan: list[tuple[BlockTable, int]]) -> None:
        """For each `(table, n)`, slots for `n` more tokens at positions `[table.num_tokens, ...)`:
        allocates the blocks they need and copies a shared block before it is written. All of
        it, or OutOfBlocks with nothing changed, so a request's sequences grow together."""
        B = self.block_size
        if len(plan) == 1:  # the usual decode: one sequence, its slots in its own last block
            table, n = plan[0]
            start = table.num_tokens
            own_block = start % B and self.pool.refcount(table.blocks[start // B]) == 1
            if own_block and start + n <= len(table.blocks) * B:
                table.num_tokens = start + n
                return
        self._ensure_free(self.blocks_needed(plan))
        for table, n in plan:
            start = table.num_tokens
            if start % B and self.pool.refcount(table.blocks[start // B]) > 1:
                (fresh,) = self.pool.allocate(1)
                self.pending_copies.append((table.blocks[start // B], fresh))  # the copy takes our reference
                table.blocks[start // B] = fresh
                self.num_cow_copies += 1
            table.blocks.extend(self.pool.allocate(self.blocks_for(start + n) - len(table.blocks)))
            table.num_tokens = start + n

    def blocks_needed(self, plan: list[tuple[BlockTable, int]]) -> int:
        """Fresh blocks `reserve(plan)` takes: new ones, and copies of shared blocks written."""
        need = 0
        for table, n in plan:
            start = table.num_tokens
            need += self.blocks_for(start + n) - len(table.blocks)
            need += (
                start % self.block_size != 0
                and self.pool.refcount(table.blocks[start // self.block_size]) > 1
            )
        return need

    def fork(self, table: BlockTable) -> BlockTable:
        """A second holder of the same KV (a beam, a parallel sample): shares every block."""
        for b in table.blocks:
            self.pool.incref(b)
        if table.node is not None:
            self.cache.inc_lock(table.node)
        return self._register(BlockTable(list(table.blocks), table.num_tokens, table.node, table.owner))

    def release(self, table: BlockTable) -> None:
        for b in table.blocks:
            self.pool.decref(b)
        if table.node is not None:
            self.cache.dec_lock(table.node)
        table.blocks, table.num_tokens, table.node = [], 0, None
        owned = self._live.get(table.owner)
        if owned is not None:
            owned.discard(table)
            if not owned:
                del self._live[table.owner]

    def release_owner(self, owner: object) -> None:
        """Releases every live table of `owner`, uncached: what a failed step left behind."""
        for table in list(self._live.get(owner, ())):
            self.release(table)

    def drop_copies(self) -> None:
        """Forgets the pending copies (a failed step), dropping their source references."""
        for src, _ in self.pending_copies:
            self.pool.decref(src)
        self.pending_copies.clear()

    def num_live_tables(self) -> int:
        return sum(len(tables) for tables in self._live.values())

    def cache_finished(self, table: BlockTable, tokens: list[int]) -> None:
        """Caches the sequence's computed tokens (a finished or preempted sequence), then
        releases the table: its next turn, or its own resumption, finds them."""
        if self.cache is not None and table.num_tokens:
            self.cache.insert(tokens[: table.num_tokens], table.blocks)
        self.release(table)

    def cache_running(self, table: BlockTable, tokens: list[int]) -> None:
        """Caches the whole blocks of a sequence that keeps running, so that requests waiting
        on the same new prefix hit it now. The table moves its lock to the new path and swaps
        any duplicate block for the cache's own (freeing the duplicate)."""
        if self.cache is None:
            return
        full = table.num_tokens - table.num_tokens % self.block_size
        locked = table.node.end if table.node is not None else 0
        if full <= locked:
            return
        self.cache.insert(tokens[:full], table.blocks)
        match = self.cache.match_prefix(tokens[:full])
        self.cache.inc_lock(match.node)
        if table.node is not None:
            self.cache.dec_lock(table.node)
        table.node = match.node
        # Only the whole blocks of the locked path: where the insert declined a run (a hash
        # collision), the match ends early, perhaps inside a block of some other prefix.
        for i, b in enumerate(match.blocks[: match.node.end // self.block_size]):
            if table.blocks[i] != b:
                self.pool.incref(b)
                self.pool.decref(table.blocks[i])
                table.blocks[i] = b

    def run_copies(self, copy: Callable[[list[int], list[int]], None]) -> None:
        """Executes the pending copies (`copy(src, dst)`), then drops their source references."""
        if not self.pending_copies:
            return
        src, dst = map(list, zip(*self.pending_copies, strict=True))
        copy(src, dst)
        self.pending_copies.clear()
        for b in src:
            self.pool.decref(b)

    def slot_usage(self, tables: Iterable[BlockTable]) -> tuple[int, int]:
        """(token slots holding KV, token slots in blocks in use), with no copies pending. A block
        several holders share counts once, at its fullest.

        O(tables), whatever the number of blocks: every block in use is full but the last block of
        a table or of a cached leaf. The cache keeps its partly filled leaf blocks and their empty
        slots up to date (`RadixCache.partial_blocks`); a table's partly filled last block is held
        by other tables as theirs too (forks), or also by the cache, which holds it partly (a
        leaf's) or fully (a match that ended inside a cached block): copy-on-write guarantees no
        one has written past what the block's fullest holder holds. A reference beyond the tables'
        is the cache's (no copies pending).
        """
        B = self.block_size
        cache = self.cache
        partial = cache.partial_blocks if cache is not None else {}
        empty = cache.partial_empty_slots if cache is not None else 0
        fill: dict[int, int] = {}
        holders: dict[int, int] = {}
        for table in tables:
            if table.num_tokens % B:
                last = table.blocks[-1]
                fill[last] = max(fill.get(last, 0), table.num_tokens % B)
                holders[last] = holders.get(last, 0) + 1
        for block, filled in fill.items():
            if block in partial:  # also a cached leaf's last block: the fuller of the two counts
                empty += partial[block] - max(filled, partial[block])
            elif self.pool.refcount(block) == holders[block]:  # the tables' alone
                empty += B - filled
        slots = (self.pool.num_blocks - self.pool.num_free) * B
        return slots - empty, slots

    def check_invariants(self, tables: Iterable[BlockTable]) -> None:
        """Every block is free or referenced, never both; each refcount equals the references
        held by the cache, the live tables and the pending copies; locks equal the tables'."""
        tables = list(tables)
        live = {id(t) for owned in self._live.values() for t in owned}
        assert live == {id(t) for t in tables}, "a live table is held by no sequence (leaked) or unregistered"
        refs: Counter[int] = Counter(src for src, _ in self.pending_copies)
        locks: Counter[int] = Counter()
        for t in tables:
            assert len(t.blocks) == self.blocks_for(t.num_tokens), f"{t} holds the wrong number of blocks"
            refs.update(t.blocks)
            node = t.node
            while node is not None and node.parent is not None:
                locks[node.id] += 1
                node = node.parent
        if self.cache is not None:
            self.cache.check_invariants()
            refs.update(self.cache.referenced_blocks())
            for node in self.cache.nodes():
                if node is not self.cache.root:
                    assert node.lock_ref == locks[node.id], f"{node} lock_ref, tables hold {locks[node.id]}"
        free = self.pool.free_blocks()
        assert len(set(free)) == len(free), "a block is on the free list twice"
        for b in range(self.pool.num_blocks):
            count = self.pool.refcount(b)
            assert count == refs[b], f"block {b}: refcount {count}, but {refs[b]} references are held"
        assert set(free) == {b for b in range(self.pool.num_blocks) if refs[b] == 0}, "free list is wrong"

    def _register(self, table: BlockTable) -> BlockTable:
        self._live.setdefault(table.owner, set()).add(table)
        return table

    def _ensure_free(self, n: int) -> None:
        if n > self.pool.num_free and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        if n > self.pool.num_free:
            raise OutOfBlocks(n, self.pool.num_free)
