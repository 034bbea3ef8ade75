"""Tier movement of the radix cache: device to host and back, and the KV store's glue.

With a host tier (`HostTier`) each node knows where its KV lives: on the device (`blocks`), on
the host (`host_blocks`), or both. Device residency is closed under prefixes (a node on the
device has its parent there too), so device eviction takes nodes with no child on the device,
and moves them to the host instead of dropping them; a match through host-only nodes loads them
back into fresh device blocks, top down, as far as device blocks can be had (freeing their host
copies unless the tier writes through). The host pool evicts whole nodes by its own policy: a
node's host copy when the node is also on the device, or a host-only node with no children.

With a KV store (`store_keys`, the store's key function), every full block newly cached on the
device from computed KV is queued once for the store (a SAVE transfer: the runner copies it off
the device before anything queued later can overwrite it). A match that runs out in both tiers
continues with blocks fetched from the store (`load_stored`): they get fresh device blocks, a
FETCH transfer writes them, and they join the tree as if computed, but are not saved again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.host_tier import TransferKind
from radixkv.cache.radix_tree import MatchResult, RadixNode

if TYPE_CHECKING:
    from radixkv.kvstore.store import StoredRun


class RadixTiers:
    """Mixed into `RadixCache`, which makes `host`, `store_keys`, `transfers` and the counters."""

    def load_stored(
        self, tokens: list[int], match: MatchResult, stored: StoredRun, session: str | None
    ) -> int:
        """Continues `match` (of `tokens`, just made) with the blocks of `stored` from where its
        whole blocks end, as far as device blocks can be had: they are allocated, queued to be
        written from the fetched data, and cached as `tokens`' next blocks. Returns the tokens
        added; match again to use them."""
        B = self.block_size
        start = match.node.end // B
        first = start - stored.first_block
        if first < 0:  # the tree lost blocks before the run since it was looked up: no chain
            return 0
        run = stored.blocks[first : len(tokens) // B - stored.first_block]
        if not run:
            return 0
        self.inc_lock(match.node)
        if len(run) > self.pool.num_free:
            self.evict(len(run) - self.pool.num_free)
        run = run[: self.pool.num_free]
        if run:
            blocks = self.pool.allocate(len(run))
            self.transfers.add(TransferKind.FETCH, run, blocks)
            self.num_fetched += len(run)
            end = (start + len(run)) * B
            self._insert(tokens[:end], self._path_blocks(match.node) + blocks, session, save=False)
            self.pool.decref_all(blocks)  # the tree holds its own; a block it declined (a collision) is free
        self.dec_lock(match.node)
        return len(run) * B

    def _save(self, tokens: list[int], blocks: list[int], cached: list[int], first: int) -> None:
        """Queues for the store the full blocks from `first` on that the tree took from `blocks`,
        keyed by `tokens` as the tree holds them (a salted request's are salted)."""
        full = len(tokens) // self.block_size
        keys = self.store_keys.block_keys(tokens, full)
        new = [i for i in range(first, full) if i < len(cached) and cached[i] == blocks[i]]
        if new:
            self.transfers.add(TransferKind.SAVE, [blocks[i] for i in new], [keys[i] for i in new])
            self.num_saved += len(new)

    def swap_out(self, tokens: list[int]) -> tuple[RadixNode | None, int]:
        """Moves the cached path of `tokens` (just inserted) to the host tier, from its end up,
        as far as its nodes are evictable (a prefix that other sequences hold stays), and pins
        its last node on the host: the host policy never evicts it, nor (having children) the
        host-only nodes above it. Device nodes above it are evicted as usual, to the host; only
        a host tier full of pinned KV drops them (their sequences recompute). Returns the pinned
        node (None when nothing of it is cached) and the device blocks written to the host.
        Pair with `unpin`. No device block stays locked for a sequence that is not running, so
        swapped requests can never hold the device pool against their own readmission."""
        offloaded = self.host.num_offloaded
        node, *_ = self._walk(tokens, touch=False)
        while node is not self.root and node.in_leaf_set:
            parent = node.parent
            self._detach(node)
            self._move_to_host(node)
            node = parent
        node, *_ = self._walk(tokens, touch=False)
        if node is self.root:
            return None, self.host.num_offloaded - offloaded
        self._refresh(node, _pin)
        return node, self.host.num_offloaded - offloaded

    def unpin(self, node: RadixNode) -> None:
        """Ends a `swap_out` pin (the node may have left the tree meanwhile)."""
        top = node
        while top.parent is not None:
            top = top.parent
        if top is self.root:
            self._refresh(node, _unpin)
        else:
            _unpin(node)

    def _move_to_host(self, node: RadixNode) -> int:
        """Device eviction of a detached, unlocked `node` with no child on the device: its KV is
        written to the host (unless a host copy exists) and its device blocks are released.
        When the host cannot take it, the node and its host-only subtree are dropped. Returns
        the device blocks freed."""
        if not node.host_blocks:
            host_blocks = self._allocate_host(len(node.blocks))
            self._detach(node)  # host eviction may have dropped a child and re-attached it
            if host_blocks is None:
                return self._drop_subtree(node)
            node.host_blocks = host_blocks
            self.transfers.add(TransferKind.OFFLOAD, node.blocks, host_blocks)
            self.host.num_offloaded += len(host_blocks)
        freed = self._release_device_blocks(node)
        node.blocks = []
        self._refresh(node.parent, _one_device_child_less)
        self._attach(node)
        return freed

    def _release_device_blocks(self, node: RadixNode) -> int:
        """Drops the cache's references on an unlocked node's device blocks; returns those freed."""
        self._forget_partial(node)
        for b in node.blocks:
            del self._node_of[b]
        self.evictable_size -= len(node.blocks)
        self.num_evicted += len(node.blocks)
        return self.pool.decref_all(node.blocks)

    def _allocate_host(self, n: int) -> list[int] | None:
        """`n` host blocks, evicting host copies by the host policy; None when not possible."""
        pool = self.host.pool
        if n > pool.num_blocks:
            return None
        while pool.num_free < n and self._host_nodes:
            self._drop_host_copy(self._host_nodes[0])
        if pool.num_free < n:
            return None
        return pool.allocate(n)

    def _drop_host_copy(self, node: RadixNode) -> None:
        """Host eviction: a node on both tiers keeps its device copy; a host-only node (it has
        no children) leaves the tree."""
        self._detach(node)
        self.host.num_evicted += len(node.host_blocks)
        self._free_host_copy(node)
        if node.blocks:
            self._attach(node)
        else:
            self._remove(node)

    def _free_host_copy(self, node: RadixNode) -> None:
        if node.host_blocks:  # without a host tier there are none, and no `self.host`
            self.host.pool.decref_all(node.host_blocks)
        node.host_blocks = []

    def _drop_subtree(self, node: RadixNode) -> int:
        """Drops `node` (detached, on the device, unlocked) and its host-only descendants."""
        stack = list(node.children.values())
        while stack:
            d = stack.pop()
            stack.extend(d.children.values())
            self._detach(d)
            self.host.num_evicted += len(d.host_blocks)
            self._free_host_copy(d)
        freed = self._release_device_blocks(node)
        self._remove(node)
        node.blocks, node.children, node.by_first = [], {}, {}
        return freed

    def _load_path(self, node: RadixNode) -> tuple[RadixNode, int]:
        """Loads the host-only nodes on the path to `node`, top down, while device blocks can be
        had. Returns the deepest node of the path on the device and the tokens loaded."""
        path = []
        top = node
        while top is not self.root and not top.blocks:
            path.append(top)
            top = top.parent
        self.inc_lock(node)  # nothing on the path is evicted to make room for the rest of it
        loaded = 0
        for h in reversed(path):
            need = len(h.host_blocks)
            if need > self.pool.num_free:
                self.evict(need - self.pool.num_free)
            if need > self.pool.num_free:
                break
            blocks = self.pool.allocate(need)  # the node's own reference
            self.transfers.add(TransferKind.LOAD, h.host_blocks, blocks)
            self.host.num_loaded += need
            self._set_device_blocks(h, blocks)
            if not self.host.write_through:
                self._refresh(h, self._free_host_copy)
            loaded += len(h.tokens)
            top = h
        self.dec_lock(node)
        return top, loaded

    def _adopt_path(self, node: RadixNode, blocks: list[int]) -> None:
        """The caller computed the KV of every node on the path to `node`: host-only ones take
        the caller's blocks as their device copy (a reference each), top down."""
        if self.host is None:
            return
        path = []
        while node is not self.root and not node.blocks:
            path.append(node)
            node = node.parent
        B = self.block_size
        for h in reversed(path):
            own = blocks[h.start // B : h.start // B + len(h.host_blocks)]
            self.pool.incref_all(own)
            self._set_device_blocks(h, own)

    def _set_device_blocks(self, node: RadixNode, blocks: list[int]) -> None:
        self._detach(node)
        node.blocks = list(blocks)
        for b in blocks:
            self._node_of[b] = node
        if node.lock_ref:
            self.protected_size += len(blocks)
        else:
            self.evictable_size += len(blocks)
        self._note_partial(node)
        self._refresh(node.parent, _one_device_child_more)
        self._attach(node)

    def _write_through(self, node: RadixNode) -> None:
        """With write-through, a node newly cached on the device gets its host copy now."""
        if self.host is None or not self.host.write_through or node.host_blocks:
            return
        self._detach(node)  # out of the host set while the host pool makes room
        host_blocks = self._allocate_host(len(node.blocks))
        self._detach(node)
        if host_blocks is not None:
            node.host_blocks = host_blocks
            self.transfers.add(TransferKind.OFFLOAD, node.blocks, host_blocks)
            self.host.num_offloaded += len(host_blocks)
        self._attach(node)


def _pin(node: RadixNode) -> None:
    node.host_pin += 1


def _unpin(node: RadixNode) -> None:
    node.host_pin -= 1


def _one_device_child_less(node: RadixNode) -> None:
    node.device_children -= 1


def _one_device_child_more(node: RadixNode) -> None:
    node.device_children += 1
