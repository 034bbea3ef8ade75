"""The radix prefix cache: every cached token prefix, mapped to its refcounted KV blocks.

`RadixCache` is one object made of one room per concern:

- `radix_tree`: the nodes, matching and the edits of the tree's shape (token-granular matches,
  xxhash-keyed children, splits);
- `radix_eviction`: locks, the evictable sets in each policy's order, and `evict`;
- `radix_groups`: the blocks of sliding-window KV groups beside group 0, and their staleness;
- `radix_tiers`: device to host and back, swap, and the KV store's saves and fetches;
- `radix_invariants`: `check_invariants`, the recount of all of it.

This module holds the state they share and the two entry points that cross every concern:
`match_prefix` (which may load from the host) and `insert` (which may save to the store).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.eviction import LRU, EvictionPolicy, SessionAware
from radixkv.cache.host_tier import HostTier, TransferQueue
from radixkv.cache.radix_eviction import RadixEviction
from radixkv.cache.radix_groups import RadixGroups
from radixkv.cache.radix_invariants import RadixInvariants
from radixkv.cache.radix_tiers import RadixTiers
from radixkv.cache.radix_tree import InsertResult, MatchResult, RadixNode, RadixTree

if TYPE_CHECKING:
    from radixkv.kvstore.keys import KeySpace


class RadixCache(RadixTiers, RadixGroups, RadixEviction, RadixInvariants, RadixTree):
    def __init__(
        self,
        pool: BlockPool,
        policy: EvictionPolicy | None = None,
        host: HostTier | None = None,
        store_keys: KeySpace | None = None,
    ) -> None:
        self.pool = pool
        self.store_keys = store_keys
        if store_keys is not None and store_keys.block_size != pool.block_size:
            raise ValueError("the KV store's block size must be the device pool's")
        self.num_saved = 0  # blocks queued for the KV store
        self.num_fetched = 0  # blocks fetched from the KV store into the tree
        self.block_size = pool.block_size
        self.policy = policy or LRU()
        self.policy.sized(pool.num_blocks, pool.block_size)
        self.host = host
        if host is not None and host.pool.block_size != pool.block_size:
            raise ValueError("the host tier's block size must be the device pool's")
        self.transfers = TransferQueue()  # shared with the KVCacheManager: one order for all
        self._ids = itertools.count()
        self._clock = 0
        self.root = RadixNode(next(self._ids), None, 0, [], [], 0)
        self.root.lock_ref = 1  # the root is never evictable
        self._leaves = SortedList(key=self._leaf_key)  # device-evictable nodes, next to go first
        self._host_nodes = SortedList(key=self._host_key)  # host-evictable nodes, next first
        self.evictable_size = 0  # device blocks of unlocked nodes
        self.protected_size = 0  # device blocks of locked nodes
        self.num_evicted = 0  # blocks that left the device (to the host, or dropped)
        self.live_sessions: set[str] = set()  # the policy's own set when it ranks by session
        if isinstance(self.policy, SessionAware):
            self.live_sessions = self.policy.live
        self._node_of: dict[int, RadixNode] = {}  # cached device block -> the node holding it
        # The last device block of each node that ends inside it, with its token count: every
        # other cached block is full, so a usage meter needs only these (KVCacheManager.slot_usage).
        self.partial_blocks: dict[int, int] = {}
        self.windows: tuple[int | None, ...] = ()  # KV groups 1..: their windows (set_groups)
        self.null_block = -1
        # Group blocks out of every window of their path's end -> when they were made stale or
        # last matched: cached still (a match may read them), released before anything else is
        # evicted (set_groups, `_release_stale`).
        self.stale: dict[int, int] = {}
        self._stale_tick = 0

    def match_prefix(self, tokens: list[int], session: str | None = None) -> MatchResult:
        """Longest cached prefix of `tokens`, token-granular. Splits a node so that the result's
        node ends at the last whole matched block (exact locking). `session` tags the matched
        nodes as that chat session's (for the `session` policy). Host-only nodes on the path
        are loaded back to the device, as many as device blocks can be had for."""
        self._clock += 1
        node, pos, child, common = self._walk(tokens, touch=True, session=session)
        matched = pos + common
        full = matched - matched % self.block_size
        partial: RadixNode | None = None
        if child is not None:
            if full > pos:
                node = self._split(child, full - pos)
                self._touch(node, session)
            if matched > full:
                partial = child
        elif pos > full:  # a leaf that ends inside its last block, matched whole
            partial = node
            node = self._split(node, full - node.start) if full > node.start else node.parent
        host_tokens = 0
        on_host = node is not self.root and not node.blocks
        if self.host is not None and (on_host or (partial is not None and not partial.blocks)):
            anchor = partial if partial is not None else node
            self.inc_lock(anchor)  # loads evict: keep the whole match, partial block included
            if on_host:
                deepest, host_tokens = self._load_path(node)
                if deepest is not node:
                    node, partial = deepest, None
            if partial is not None and not partial.blocks:  # a partly matched block on the host
                if len(partial.tokens) > self.block_size:
                    partial = self._split(partial, self.block_size)
                loaded, _ = self._load_path(partial)
                if loaded is partial:
                    host_tokens += matched - full
                else:
                    partial = None
            self.dec_lock(anchor)
        blocks = self._path_blocks(node)
        extra = self._path_extra(node, partial) if self.windows else ()
        if partial is not None:
            blocks.append(partial.blocks[0])
            self._rekey(partial)  # its first block is read now, though the node is not matched whole
        return MatchResult(node, node.end if partial is None else matched, blocks, host_tokens, extra)

    def insert(
        self,
        tokens: list[int],
        blocks: list[int],
        session: str | None = None,
        extra: list[list[int]] | tuple[list[int], ...] = (),
    ) -> InsertResult:
        """Caches `tokens` whose KV is in `blocks` (at least `ceil(len(tokens) / block_size)`).

        The cache takes its own reference on each block it keeps; the caller keeps its own and
        drops them as usual. Where the cache already holds a prefix on the device, its blocks
        stay and the caller's are reported redundant; where it holds it on the host only, the
        node takes the caller's blocks as its device copy. A leaf that ends inside a block and
        is extended takes the caller's fuller copy of that block in place of its own.
        With a KV store, the full blocks it caches anew are queued for the store. `extra`: the
        blocks of KV groups 1.. beside `blocks` (`set_groups`), null where released; the tree
        takes them where it has none of its own, then releases what left the windows.
        """
        if self.windows and len(extra) != len(self.windows):
            raise ValueError(f"insert needs {len(self.windows)} group tables beside blocks, got {len(extra)}")
        return self._insert(tokens, blocks, session, save=True, extra=extra)

    def _insert(
        self,
        tokens: list[int],
        blocks: list[int],
        session: str | None,
        save: bool,
        extra: list[list[int]] | tuple[list[int], ...] = (),
    ) -> InsertResult:
        n = len(tokens)
        nb = -(-n // self.block_size)
        if len(blocks) < nb:
            raise ValueError(f"{n} tokens need {nb} blocks, got {len(blocks)}")
        self._clock += 1
        node, pos, child, common = self._walk(tokens, touch=True, session=session)
        num_cached = pos + common
        B = self.block_size
        self._adopt_path(node, blocks)
        if pos < n:
            if child is None and pos % B:
                ext = [e[pos // B : nb] for e in extra]
                self._extend_leaf(node, tokens[pos:], blocks[pos // B : nb], ext)
            elif child is None:
                ext = [e[pos // B : nb] for e in extra]
                self._add_leaf(node, tokens[pos:], blocks[pos // B : nb], session, ext)
            elif pos + common < n:
                at = common - common % B
                parent = node
                if at:
                    parent = self._split(child, at)
                    self._touch(parent, session)
                    self._adopt_path(parent, blocks)
                ext = [e[(pos + at) // B : nb] for e in extra]
                self._add_leaf(parent, tokens[pos + at :], blocks[(pos + at) // B : nb], session, ext)
        if self.windows:
            self._fill_and_slide(tokens, extra)
        cached = self._blocks_along(tokens, nb)
        redundant = [b for b, c in zip(blocks[:nb], cached, strict=False) if b != c]
        if save and self.store_keys is not None and n // B > num_cached // B:
            self._save(tokens, blocks, cached, num_cached // B)
        return InsertResult(num_cached, redundant)
