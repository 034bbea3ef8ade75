"""Growing sequences' tables: blocks allocated on demand, copy-on-write, forks.

A block that more than one holder references is never written in place: the writer gets a
fresh block and a pending copy that the model runner executes before the step's forward pass.
Until then the copy keeps a reference on its source, so eviction or a release in the same
scheduling step can never hand the source to someone else too early. When the pool runs dry the
cache is evicted first (`_ensure_free`), and only then `OutOfBlocks` reaches the scheduler, with
nothing changed. A sliding group's blocks that left every window to come are released first.
"""

from __future__ import annotations

from radixkv.cache.block_pool import OutOfBlocks
from radixkv.cache.block_table import BlockTable
from radixkv.cache.host_tier import TransferKind
from radixkv.cache.kv_groups import sliding_keep_from


class KVGrowth:
    """Mixed into `KVCacheManager`, which holds `pool`, `cache`, `transfers`, `windows`,
    `null_block`, `num_cow_copies` and registers tables (`_register`)."""

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
            list(table.blocks),
            table.num_tokens,
            table.node,
            table.owner,
            table.session,
            key_offset=table.key_offset,
            extra=[list(e) for e in table.extra],
        )
        return self._register(copy)

    def _ensure_free(self, n: int) -> None:
        if n > self.pool.num_free and self.cache is not None:
            self.cache.evict(n - self.pool.num_free)
        if n > self.pool.num_free:
            raise OutOfBlocks(n, self.pool.num_free)
