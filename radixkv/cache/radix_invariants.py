"""The radix cache's invariants, recounted from scratch: what every random-operation test and
`KVCacheManager.check_invariants` call after each step to prove the books exact."""

from __future__ import annotations

from radixkv.cache.radix_tree import block_key
from radixkv.errors import InvariantError


class RadixInvariants:
    """Mixed into `RadixCache`: the recount reads every concern's state."""

    def check_invariants(self) -> None:
        """Structure, keys, residency, sizes and both evictable sets agree with a recount."""
        B = self.block_size
        evictable = protected = 0
        leaves, host_nodes = set(), set()
        partial: dict[int, int] = {}
        seen: set[int] = set()
        seen_host: set[int] = set()
        for node in self.nodes():
            if node.device_children != sum(bool(c.blocks) for c in node.children.values()):
                raise InvariantError(f"{node} miscounts its children on the device")
            if node is self.root:
                continue
            p = node.parent
            nb = -(-len(node.tokens) // B)
            if p is None or node.start != p.end:
                raise InvariantError(f"{node} does not start where its parent ends")
            if node.start % B:
                raise InvariantError(f"{node} starts inside a block")
            if not node.tokens:
                raise InvariantError(f"{node} has an empty edge")
            if not node.blocks and not node.host_blocks:
                raise InvariantError(f"{node} has its KV nowhere")
            if len(node.blocks) not in (0, nb):
                raise InvariantError(f"{node} has the wrong number of blocks")
            if len(node.host_blocks) not in (0, nb):
                raise InvariantError(f"{node} has the wrong number of host blocks")
            if node.host_blocks and self.host is None:
                raise InvariantError(f"{node} is on a host tier that is off")
            if node.blocks and p is not self.root and not p.blocks:
                raise InvariantError(f"{node} is on the device, its parent not")
            if node.children and node.end % B:
                raise InvariantError(f"inner {node} ends inside a block")
            if p.children.get(block_key(node.tokens[:B])) is not node:
                raise InvariantError(f"{node} is not under its key")
            if node not in p.by_first[node.tokens[0]]:
                raise InvariantError(f"{node} is missing from its first-token index")
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
                raise InvariantError(f"{node} lock")
            if len(node.extra) != len(self.windows):
                raise InvariantError(f"{node} has {len(node.extra)} group tables, not {len(self.windows)}")
            group_blocks = []
            for e, w in zip(node.extra, self.windows, strict=True):
                if len(e) != len(node.blocks):
                    raise InvariantError(f"{node}: a group holds {len(e)} blocks, group 0 {len(node.blocks)}")
                if w is None and self.null_block in e:
                    raise InvariantError(f"{node} released a block of a group without a window")
                group_blocks += [b for b in e if b != self.null_block]
            for b in node.blocks + group_blocks:
                if b in seen or b == self.null_block:
                    raise InvariantError(f"block {b} is held by two nodes (or is the null block)")
                if self._node_of.get(b) is not node:
                    raise InvariantError(f"block {b} is not mapped to {node}")
                if self.pool.refcount(b) < 1:
                    raise InvariantError(f"cached block {b} is free")
                seen.add(b)
            for b in node.host_blocks:
                if b in seen_host:
                    raise InvariantError(f"host block {b} is held by two nodes")
                seen_host.add(b)
            if node.blocks and len(node.tokens) % B:
                partial[node.blocks[-1]] = len(node.tokens) % B
                for e in node.extra:
                    if e[-1] != self.null_block:
                        partial[e[-1]] = len(node.tokens) % B
            live = len(node.blocks) + sum(b not in self.stale for b in group_blocks)
            if node.lock_ref:
                protected += live
            else:
                evictable += live
            if self._device_evictable(node):
                leaves.add(node.id)
            if self.host is not None and self._host_evictable(node):
                host_nodes.add(node.id)
        if len(self._node_of) != len(seen):
            raise InvariantError("the block map holds blocks no node has")
        if any(b not in seen or self._node_of[b].blocks.count(b) for b in self.stale):
            raise InvariantError("a stale block is no cached group block")
        for node in self.nodes():
            if sum(len(v) for v in node.by_first.values()) != len(node.children):
                raise InvariantError(f"{node} index")
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise InvariantError(
                f"sizes {self.evictable_size}/{self.protected_size}, recount {evictable}/{protected}"
            )
        if {n.id for n in self._leaves} != leaves:
            raise InvariantError("evictable leaf set is stale")
        if {n.id for n in self._host_nodes} != host_nodes:
            raise InvariantError("host-evictable set is stale")
        if partial != self.partial_blocks:
            raise InvariantError("partly filled cached blocks are miscounted")
        keys = [self._leaf_key(n) for n in self._leaves]
        if keys != sorted(keys):
            raise InvariantError("evictable leaves are out of order")
        self.policy.check_leaves(self._leaves)
        keys = [self._host_key(n) for n in self._host_nodes]
        if keys != sorted(keys):
            raise InvariantError("host-evictable nodes are out of order")
