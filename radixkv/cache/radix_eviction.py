"""Locks and eviction order of the radix cache: which nodes may go, and in which order.

Locking a node (and so its path to the root) keeps its blocks from eviction; `evictable_size`
and `protected_size` (device blocks) are kept exact as locks move, so admission can trust them.
Two sorted sets hold the candidates, each ordered by its policy's key: the device-evictable
leaves (unlocked, on the device, no child on the device) under the cache's `EvictionPolicy`, and
with a host tier the host-evictable nodes under the host's. A node leaves its sets before
anything its key reads changes and comes back after (`_detach`, `_attach`, `_refresh`), so the
sets are always sorted. Eviction trims unlocked leaves from their tail, least valuable first.
"""

from __future__ import annotations

from collections.abc import Callable

from radixkv.cache.eviction import SessionAware
from radixkv.cache.radix_tree import RadixNode


class RadixEviction:
    """Mixed into `RadixCache`, which makes `_leaves` and `_host_nodes` (sorted by `_leaf_key`
    and `_host_key`) and the sizes."""

    def inc_lock(self, node: RadixNode) -> None:
        """Protects `node` and its ancestors from eviction; pair with `dec_lock`."""
        self._stale_tick += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._detach(node)
                for e in node.extra:  # the lockers hold the group blocks they read themselves
                    for b in e:
                        self._make_stale(node, b)
                held = self._held(node) if node.extra else len(node.blocks)
                self.evictable_size -= held
                self.protected_size += held
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError(f"{node} is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                held = self._held(node) if node.extra else len(node.blocks)
                self.evictable_size += held
                self.protected_size -= held
                self._attach(node)
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Frees device blocks from unlocked leaves, trimming each from its tail, until
        `num_blocks` are free or nothing is evictable (with KV groups, a position's blocks go
        together: up to groups - 1 more). Returns how many blocks it freed. A block
        that a live sequence still references loses only the cache's reference and is not
        counted. With a host tier the evicted blocks' KV moves to the host (when the node has no
        host copy yet) and the node stays in the tree."""
        freed = self._release_stale(num_blocks) if self.stale else 0
        while freed < num_blocks and self._leaves:
            leaf = self.policy.arrange(self._leaves, self._refresh)
            self._detach(leaf)
            self.policy.evicted(leaf)
            # a position's blocks of every group go together: up to (groups - 1) past num_blocks
            want = -(-(num_blocks - freed) // (1 + len(leaf.extra)))
            take = min(want, 1 if self.policy.keys_blocks else len(leaf.blocks))
            keep = len(leaf.blocks) - take
            if self.host is not None:
                if keep:
                    upper = self._split(leaf, keep * self.block_size)
                    self._refresh(upper, self.policy.trimmed)
                    self._detach(leaf)
                freed += self._move_to_host(leaf)
                continue
            self._forget_partial(leaf)  # its last block is among those taken
            freed += self.pool.decref_all(leaf.blocks[keep:])
            for block in leaf.blocks[keep:]:
                del self._node_of[block]
            self.evictable_size -= take
            self.num_evicted += take
            for e in leaf.extra:
                for i in range(len(e) - 1, keep - 1, -1):
                    block = e[i]
                    freed += block != self.null_block and self.pool.refcount(block) == 1
                    self._drop(leaf, e, i)
                del e[keep:]
            if keep:
                del leaf.blocks[keep:]
                del leaf.tokens[keep * self.block_size :]
                self.policy.trimmed(leaf)
                self._attach(leaf)
            else:
                self._remove(leaf)
        return freed

    def set_session_live(self, session: str, live: bool) -> None:
        """Marks a chat session live (it has more turns to come) or closed. Under the `session`
        policy, which ranks leaves by it, the evictable leaves the session last touched are re-keyed
        (a scan of the evictable leaves); no other policy looks at sessions, so nothing moves."""
        if (session in self.live_sessions) == live:
            return
        ranked = isinstance(self.policy, SessionAware)
        moved = [n for n in self._leaves if n.session == session] if ranked else []
        for node in moved:
            self._detach(node)
        if live:
            self.live_sessions.add(session)
        else:
            self.live_sessions.discard(session)
        for node in moved:
            self._attach(node)

    def evictable_block(self, block: int) -> bool:
        """Whether `block` is cached in an unlocked node, or stale (eviction may take it)."""
        node = self._node_of.get(block)
        return node is not None and (node.lock_ref == 0 or block in self.stale)

    def _leaf_key(self, node: RadixNode) -> tuple:
        return (self.policy.key(node), node.id)

    def _host_key(self, node: RadixNode) -> tuple:
        return (self.host.policy.key(node), node.id)

    def _device_evictable(self, node: RadixNode) -> bool:
        return node.lock_ref == 0 and bool(node.blocks) and node.device_children == 0

    def _host_evictable(self, node: RadixNode) -> bool:
        return (
            node.lock_ref == 0
            and node.host_pin == 0
            and bool(node.host_blocks)
            and (bool(node.blocks) or not node.children)
        )

    def _detach(self, node: RadixNode) -> None:
        """Takes `node` out of the evictable sets, before anything its keys read changes."""
        if node.in_leaf_set:
            self._leaves.remove(node)
            node.in_leaf_set = False
            self.policy.left(node)
        if node.in_host_set:
            self._host_nodes.remove(node)
            node.in_host_set = False

    def _attach(self, node: RadixNode) -> None:
        """Puts `node` back into the evictable sets it now belongs to."""
        if node is self.root:
            return
        if not node.in_leaf_set and self._device_evictable(node):
            self._leaves.add(node)
            node.in_leaf_set = True
            self.policy.entered(node)
        if not node.in_host_set and self.host is not None and self._host_evictable(node):
            self._host_nodes.add(node)
            node.in_host_set = True

    def _refresh(self, node: RadixNode, change: Callable[[RadixNode], None]) -> None:
        self._detach(node)
        change(node)
        self._attach(node)
