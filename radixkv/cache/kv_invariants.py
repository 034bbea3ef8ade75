"""The manager's books recounted from scratch: every block's refcount against the references
the cache, the live tables and the pending copies hold, every lock and host pin against the
tables and swapped paths, and both free lists. What every random-operation test and
`EngineCore.check_invariants` call after each step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.block_table import BlockTable
from radixkv.cache.kv_groups import sliding_keep_from
from radixkv.errors import InvariantError


class KVInvariants:
    """Mixed into `KVCacheManager`: the recount reads every room's state."""

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
        check_pool(self.pool, refs, "block")
        host = self.cache.host if self.cache is not None else None
        if host is not None:
            check_pool(host.pool, Counter(self.cache.referenced_host_blocks()), "host block")

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


def check_pool(pool: BlockPool, held: Counter[int], what: str) -> None:
    """`pool`'s refcounts are the references `held` counts, and its free list is exactly the
    blocks nobody holds, each once; `what` names its blocks in the error ("block", "host block")."""
    free = pool.free_blocks()
    if len(set(free)) != len(free):
        raise InvariantError(f"a {what} is on the free list twice")
    for b in range(pool.num_blocks):
        count = pool.refcount(b)
        if count != held[b]:
            raise InvariantError(f"{what} {b}: refcount {count}, but {held[b]} references are held")
    if set(free) != {b for b in range(pool.num_blocks) if not held[b]}:
        raise InvariantError(f"the {what} free list is wrong")
