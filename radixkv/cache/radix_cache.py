"""The radix prefix cache: every cached token prefix, mapped to its refcounted KV blocks.

Edges are runs of token ids; each node holds the physical blocks under its edge. Edges start on
block boundaries, so every block belongs to exactly one node and a node's blocks are
`ceil(len(edge) / block_size)`. Only a leaf may end inside a block: its last block is partly
filled. Matching is token-granular all the same: a match that ends inside a block returns that
block as its last, partly matched one, and the caller copies it (copy-on-write) instead of
recomputing up to `block_size - 1` tokens, which a block-granular cache would lose.

A child is found in O(1) by the xxhash of its first block of tokens, and the tokens are always
compared as well, so a hash collision can never return wrong KV. When no child's first block
matches whole, the children that share the next token are scanned for the longest common run
inside that block; that happens at most once per lookup, at its end.

Locking a node (and so its path to the root) keeps its blocks from eviction; `evictable_size`
and `protected_size` (device blocks) are kept exact as locks move, so admission can trust them.
Eviction trims unlocked leaves from their tail, least valuable first under a pluggable policy.

With a host tier (`HostTier`) each node knows where its KV lives: on the device (`blocks`), on
the host (`host_blocks`), or both. Device residency is closed under prefixes (a node on the
device has its parent there too), so device eviction takes nodes with no child on the device,
and moves them to the host instead of dropping them; a match through host-only nodes loads them
back into fresh device blocks, top down, as far as device blocks can be had (freeing their host
copies unless the tier writes through). The host pool evicts
whole nodes by its own policy: a node's host copy when the node is also on the device, or a
host-only node with no children.

With a KV store (`store_keys`, the store's key function), every full block newly cached on the
device from computed KV is queued once for the store (a SAVE transfer: the runner copies it off
the device before anything queued later can overwrite it). A match that runs out in both tiers
continues with blocks fetched from the store (`load_stored`): they get fresh device blocks, a
FETCH transfer writes them, and they join the tree as if computed, but are not saved again.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import xxhash
from sortedcontainers import SortedList

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.eviction import LRU, EvictionPolicy, SessionAware
from radixkv.cache.host_tier import HostTier, TransferKind, TransferQueue
from radixkv.cache.kv_groups import sliding_keep_from
from radixkv.errors import InvariantError

if TYPE_CHECKING:
    from radixkv.kvstore.keys import KeySpace
    from radixkv.kvstore.store import StoredRun


class RadixNode:
    __slots__ = (
        "blocks",
        "by_first",
        "children",
        "device_children",
        "extra",
        "hits",
        "host_blocks",
        "host_pin",
        "id",
        "in_host_set",
        "in_leaf_set",
        "last_access",
        "lock_ref",
        "parent",
        "priority",
        "session",
        "start",
        "tokens",
    )

    def __init__(
        self,
        node_id: int,
        parent: RadixNode | None,
        start: int,
        tokens: list[int],
        blocks: list[int],
        last_access: int,
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.start = start  # tokens before this edge; a multiple of block_size
        self.tokens = tokens
        self.blocks = blocks  # device blocks; empty when the KV lives on the host only
        self.extra: list[list[int]] = []  # KV groups 1..: their blocks, null where released
        self.host_blocks: list[int] = []  # host blocks; empty when there is no host copy
        self.host_pin = 0  # swapped-out sequences ending here: the host tier must not evict it
        self.children: dict[int, RadixNode] = {}  # xxhash of the child's first block of tokens
        self.by_first: dict[int, list[RadixNode]] = {}  # the child's first token -> children
        self.device_children = 0  # children with device blocks
        self.lock_ref = 0
        self.last_access = last_access
        self.hits = 0
        self.priority = 0.0  # the eviction policy's own score, set in its `touched`
        self.session: str | None = None  # the chat session that last touched this node
        self.in_leaf_set = False  # among the device-evictable leaves
        self.in_host_set = False  # among the host-evictable nodes

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def __repr__(self) -> str:
        span = f"[{self.start}, {self.end})"
        where = f"blocks={self.blocks}, host={self.host_blocks}"
        return f"RadixNode(id={self.id}, {span}, {where}, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    """The longest cached prefix of a query that is on the device (after loading host blocks).

    `blocks` covers `ceil(num_tokens / block_size)` blocks. When `num_tokens` is not a multiple
    of the block size the last block is only partly matched: share it, and the first write
    copies it. `node` ends exactly at the last whole matched block; lock it to keep those blocks.
    `host_tokens` of them were loaded from the host tier by this match. `extra`: the blocks of
    KV groups 1.. along the same prefix (`RadixCache.set_groups`), null where released.
    """

    node: RadixNode
    num_tokens: int
    blocks: list[int]
    host_tokens: int = 0
    extra: tuple[list[int], ...] = ()


class InsertResult(NamedTuple):
    """`num_cached`: leading tokens already cached before the insert. `redundant`: the caller's
    blocks that the cache did not take because it holds the same KV already; they are freed
    when the caller drops its references."""

    num_cached: int
    redundant: list[int]


def block_key(tokens: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(array("q", tokens).tobytes())


class RadixCache:
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

    def set_groups(self, windows: tuple[int | None, ...], null_block: int) -> None:
        """Caches KV groups 1.. (`radixkv.cache.kv_groups`) beside group 0, whose residency and
        eviction every node follows: `node.extra[g - 1]` is group g's blocks of the node, as many
        as `node.blocks`, `null_block` where released. A sliding group (window w) needs, along
        each path, only the blocks a match at the end of the path reads: after an insert of n
        tokens, the blocks wholly before n - w become stale up the path while no other branch
        ends there (up to the first node with another child). A stale block stays cached, so a
        match inside the path (a shared system prompt, say) still finds it, but it counts as
        free: `evict` releases stale blocks first (`_release_stale`), and only then whole leaves
        (`stale`, `num_stale`), as a sliding block freed by vLLM stays cached until reused. An
        insert whose window needs a stale block makes it live again. Locking a node makes its
        group blocks stale too: the tables that lock it hold the ones they read, so a locked
        path never keeps the pool from them. A match never checks the
        groups itself: the caller cuts it to where every window is held
        (`KVCacheManager.admit`). No host tier or KV store yet: their transfers move group 0."""
        if self.host is not None or self.store_keys is not None:
            raise ValueError("sliding-window KV groups do not support a host tier or a KV store yet")
        if self.num_cached_blocks:
            raise ValueError("set_groups needs an empty cache")
        self.windows, self.null_block = tuple(windows), null_block
        self.root.extra = [[] for _ in windows]

    # ----------------------------------------------------------------- lookups

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

    def _path_extra(self, node: RadixNode, partial: RadixNode | None) -> tuple[list[int], ...]:
        """Groups 1..'s blocks along the path to `node`, then `partial`'s first block."""
        chain = []
        while node is not self.root:
            chain.append(node)
            node = node.parent
        out = tuple([] for _ in self.windows)
        for n in reversed(chain):
            for group, blocks in zip(out, n.extra, strict=True):
                group.extend(blocks)
        if partial is not None:
            for group, blocks in zip(out, partial.extra, strict=True):
                group.append(blocks[0])
        return out

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` are cached, on either tier; changes nothing."""
        _, pos, _, common = self._walk(tokens, touch=False)
        return pos + common

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

    def _save(self, tokens: list[int], blocks: list[int], cached: list[int], first: int) -> None:
        """Queues for the store the full blocks from `first` on that the tree took from `blocks`,
        keyed by `tokens` as the tree holds them (a salted request's are salted)."""
        full = len(tokens) // self.block_size
        keys = self.store_keys.block_keys(tokens, full)
        new = [i for i in range(first, full) if i < len(cached) and cached[i] == blocks[i]]
        if new:
            self.transfers.add(TransferKind.SAVE, [blocks[i] for i in new], [keys[i] for i in new])
            self.num_saved += len(new)

    # ---------------------------------------------------------- locks, evict

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
            self.policy.arrange(self._leaves, self._refresh)
            leaf = self._leaves[0]
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

    # ----------------------------------------------------------- inspection

    def evictable_block(self, block: int) -> bool:
        """Whether `block` is cached in an unlocked node, or stale (eviction may take it)."""
        node = self._node_of.get(block)
        return node is not None and (node.lock_ref == 0 or block in self.stale)

    @property
    def num_cached_blocks(self) -> int:
        return self.evictable_size + self.protected_size

    def cached_sequences(self) -> list[list[int]]:
        """The token sequence of every leaf: everything the cache can match is a prefix of one."""
        out = []
        stack = [(self.root, [])]
        while stack:
            node, prefix = stack.pop()
            seq = prefix + node.tokens
            if not node.children and node is not self.root:
                out.append(seq)
            stack.extend((c, seq) for c in node.children.values())
        return out

    def referenced_blocks(self) -> list[int]:
        null = self.null_block
        out = [b for node in self.nodes() for b in node.blocks]
        out += [b for node in self.nodes() for e in node.extra for b in e if b != null]
        return out

    def referenced_host_blocks(self) -> list[int]:
        return [b for node in self.nodes() for b in node.host_blocks]

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

    # ------------------------------------------------------------ internals

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

    def nodes(self) -> Iterator[RadixNode]:
        """Every node, the root included, in no particular order."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _walk(
        self, tokens: list[int], touch: bool, session: str | None = None
    ) -> tuple[RadixNode, int, RadixNode | None, int]:
        """Follows whole edges from the root. Returns (node, pos, child, common): `node` ends at
        `pos`, and `child` is the child of `node` whose edge matches only its first `common`
        tokens (None when no child matches at all)."""
        node, pos, n = self.root, 0, len(tokens)
        while pos < n:
            child, common = self._child_for(node, tokens, pos)
            if child is None:
                return node, pos, None, 0
            if common < len(child.tokens):
                return node, pos, child, common
            if touch:
                self._touch(child, session)
            node, pos = child, pos + common
        return node, pos, None, 0

    def _child_for(self, node: RadixNode, tokens: list[int], pos: int) -> tuple[RadixNode | None, int]:
        B = self.block_size
        head = tokens[pos : pos + B]
        child = node.children.get(block_key(head))
        if child is not None and child.tokens[:B] == head:
            edge = child.tokens
            if tokens[pos : pos + len(edge)] == edge:  # the whole edge, as on most of a long match's path
                return child, len(edge)
            return child, len(head) + _common_len(edge, len(head), tokens, pos + len(head), B)
        best, best_len = None, 0
        for cand in node.by_first.get(tokens[pos], ()):
            k = _common_len(cand.tokens, 0, tokens, pos, B, limit=B)
            if k > best_len:
                best, best_len = cand, k
        return best, best_len

    def _touch(self, node: RadixNode, session: str | None) -> None:
        self._detach(node)
        node.last_access = self._clock
        node.hits += 1
        if session is not None:
            node.session = session
        self.policy.touched(node)
        self._attach(node)

    def _rekey(self, node: RadixNode) -> None:
        """Lets the policy look at `node` again without counting an access."""
        self._refresh(node, self.policy.touched)

    def _path_blocks(self, node: RadixNode) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.blocks)
            node = node.parent
        return [b for part in reversed(parts) for b in part]

    def _blocks_along(self, tokens: list[int], nb: int) -> list[int]:
        node, _, child, _ = self._walk(tokens, touch=False)
        blocks = self._path_blocks(node)
        if child is not None:
            blocks.extend(child.blocks)
        return blocks[:nb]

    def _link(self, parent: RadixNode, node: RadixNode, key: int) -> None:
        parent.children[key] = node
        parent.by_first.setdefault(node.tokens[0], []).append(node)
        node.parent = parent

    def _unlink(self, node: RadixNode) -> None:
        parent = node.parent
        del parent.children[block_key(node.tokens[: self.block_size])]
        siblings = parent.by_first[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del parent.by_first[node.tokens[0]]

    def _add_leaf(
        self,
        parent: RadixNode,
        tokens: list[int],
        blocks: list[int],
        session: str | None,
        extra: list[list[int]] = (),
    ) -> None:
        key = block_key(tokens[: self.block_size])
        if key in parent.children:
            return  # a 64-bit hash collision: leave this run uncached rather than risk mixing KV
        self._detach(parent)
        node = RadixNode(next(self._ids), parent, parent.end, tokens, list(blocks), self._clock)
        node.session = session
        self._link(parent, node, key)
        parent.device_children += 1
        self.pool.incref_all(blocks)
        for b in blocks:
            self._node_of[b] = node
        self.evictable_size += len(blocks)
        node.extra = [list(e) for e in extra]
        for e in node.extra:
            for b in e:
                if b != self.null_block:
                    self._hold(node, b)
        self._note_partial(node)
        self.policy.touched(node)
        self._attach(parent)
        self._attach(node)
        self._write_through(node)

    def _extend_leaf(
        self, leaf: RadixNode, tokens: list[int], blocks: list[int], extra: list[list[int]] = ()
    ) -> None:
        """`leaf` ends inside its last block; `blocks[0]` holds that block's tokens and more."""
        B = self.block_size
        key = block_key((leaf.tokens + tokens[:B])[:B])  # the first block of tokens may grow
        sibling = leaf.parent.children.get(key)
        if sibling is not None and sibling is not leaf:
            return  # a hash collision, as in _add_leaf
        self._detach(leaf)
        self._unlink(leaf)
        self._free_host_copy(leaf)  # its last block is about to hold more than the host copy
        self._forget_partial(leaf)
        if blocks[0] != leaf.blocks[-1]:
            self.pool.incref(blocks[0])
            self.pool.decref(leaf.blocks[-1])
            del self._node_of[leaf.blocks[-1]]
            leaf.blocks[-1] = blocks[0]
            self._node_of[blocks[0]] = leaf
        self.pool.incref_all(blocks[1:])
        for b in blocks[1:]:
            self._node_of[b] = leaf
        leaf.blocks.extend(blocks[1:])
        for mine, theirs in zip(leaf.extra, extra, strict=True):
            # its last block is theirs now, in every group (null where they released it)
            if mine[-1] != theirs[0]:
                self._drop(leaf, mine, len(mine) - 1)
                if theirs[0] != self.null_block:
                    self._hold(leaf, theirs[0])
                    mine[-1] = theirs[0]
            for b in theirs[1:]:
                if b != self.null_block:
                    self._hold(leaf, b)
            mine.extend(theirs[1:])
        leaf.tokens.extend(tokens)
        self.policy.touched(leaf)  # its end moved (the walk touched it already)
        self.evictable_size += len(blocks) - 1
        self._link(leaf.parent, leaf, key)
        self._note_partial(leaf)
        self._attach(leaf)
        self._write_through(leaf)

    # ------------------------------------------------------------ KV groups

    def _held(self, node: RadixNode) -> int:
        """Device blocks `node` holds in every group, but stale ones."""
        null, stale = self.null_block, self.stale
        return len(node.blocks) + sum(b != null and b not in stale for e in node.extra for b in e)

    def _hold(self, node: RadixNode, block: int) -> None:
        """`node` takes a reference on a group block it lists now."""
        self.pool.incref(block)
        self._node_of[block] = node
        if node.lock_ref:
            self.protected_size += 1
        else:
            self.evictable_size += 1

    def _drop(self, node: RadixNode, blocks: list[int], i: int) -> None:
        """`node` releases `blocks[i]` of one of its groups (when it holds one)."""
        b = blocks[i]
        if b == self.null_block:
            return
        blocks[i] = self.null_block
        self.pool.decref(b)
        del self._node_of[b]
        self.partial_blocks.pop(b, None)
        if b in self.stale:
            del self.stale[b]
        elif node.lock_ref:
            self.protected_size -= 1
        else:
            self.evictable_size -= 1

    def _make_stale(self, node: RadixNode, block: int) -> None:
        if block != self.null_block and block not in self.stale:
            self.stale[block] = self._stale_tick
            if node.lock_ref:
                self.protected_size -= 1
            else:
                self.evictable_size -= 1

    def _make_live(self, node: RadixNode, block: int) -> None:
        if block in self.stale:
            del self.stale[block]
            if node.lock_ref:
                self.protected_size += 1
            else:
                self.evictable_size += 1

    @property
    def num_stale(self) -> int:
        """Stale group blocks only the tree references: what releasing them all would free."""
        return sum(self.pool.refcount(b) == 1 for b in self.stale)

    def _release_stale(self, num_blocks: int) -> int:
        """Releases stale group blocks until `num_blocks` are freed; returns those freed. First
        the dead ones (`_stale_order`), then the least recently made stale or matched
        (`touch_stale`: a request waiting for room keeps its window while others grow), and
        among those by position along their path, the farthest back first, every group's block
        of a position together: a match needs the window of every group, so freeing one group's
        run of blocks while the others keep theirs loses the hits those blocks serve. One a
        table also holds stays: releasing it would free nothing and lose the hit."""
        freed = 0
        for node, blocks, i in self._stale_order():
            if freed >= num_blocks:
                break
            if self.pool.refcount(blocks[i]) == 1:
                self._drop(node, blocks, i)
                freed += 1
        return freed

    def _stale_order(self) -> list[tuple[RadixNode, list[int], int]]:
        """The stale blocks as (node, its group's blocks, index), in release order: first those
        no match can read (another group with a window at least as long released that position,
        so every window that covers it lacks a block), then by last use, then by position."""
        null, windows, B = self.null_block, self.windows, self.block_size
        order = []
        for block in self.stale:
            node = self._node_of[block]
            g = next(j for j, e in enumerate(node.extra) if block in e)
            i = node.extra[g].index(block)
            w = windows[g]
            dead = any(
                e[i] == null for h, e in enumerate(node.extra)
                if h != g and windows[h] is not None and w is not None and windows[h] >= w
            )
            order.append((not dead, self.stale[block], node.start // B + i, node, node.extra[g], i))
        order.sort(key=lambda t: t[:3])
        return [(node, blocks, i) for *_, node, blocks, i in order]

    def peek_groups(self, tokens: list[int]) -> tuple[int, tuple[list[int], ...]]:
        """How many leading tokens of `tokens` are cached, and KV groups 1..'s blocks covering
        them (null where released), as `match_prefix` would give; changes nothing."""
        node, pos, child, common = self._walk(tokens, touch=False)
        extra = self._path_extra(node, None)
        if child is not None and common:
            for group, blocks in zip(extra, child.extra, strict=True):
                group.extend(blocks[: -(-common // self.block_size)])
        return pos + common, extra

    def touch_stale(self, blocks: Iterable[int]) -> None:
        """A match read `blocks` (a sliding group's window): the stale ones among them are the
        most recently used, released after every other stale block."""
        self._stale_tick += 1
        for b in blocks:
            if b in self.stale:
                self.stale[b] = self._stale_tick

    def _fill_and_slide(self, tokens: list[int], extra: list[list[int]] | tuple[list[int], ...]) -> None:
        """After inserting `tokens` with group blocks `extra`: along the path, where a sliding
        group's window of the end needs a block the tree released, the tree takes `extra`'s; then
        it releases, from the end up while no other branch leaves the path, the blocks wholly
        before every window of the end. A sliding group's block that a match could still read
        at the end of some other branch is kept: such a match stays a hit for every group.
        (Group blocks are no part of any eviction key, so nodes stay in their sets.)"""
        B, null, n = self.block_size, self.null_block, len(tokens)
        self._stale_tick += 1
        keep = [None if w is None else sliding_keep_from(n, w, B) for w in self.windows]
        sliding = [k for k in keep if k is not None]
        if not sliding:
            return
        node, _, child, _ = self._walk(tokens, touch=False)
        path = []
        x = child if child is not None else node
        while x is not self.root:
            path.append(x)
            x = x.parent
        lowest = min(sliding) * B
        for x in path:  # fill: the windows' blocks, from the end back
            if x.end <= lowest:
                break
            base = x.start // B
            for mine, theirs, k in zip(x.extra, extra, keep, strict=True):
                if k is None:
                    continue
                # their blocks hold tokens up to n: not the rest of a block past it
                whole = min(len(mine), (n - x.start) // B + (x.end <= n))
                for i in range(max(k - base, 0), whole):
                    if mine[i] == null and theirs[base + i] != null:
                        self._hold(x, theirs[base + i])
                        mine[i] = theirs[base + i]
                    else:
                        self._make_live(x, mine[i])
            self._note_partial(x)
        for depth, x in enumerate(path):  # slide: up the path while it has no other branch
            if depth and len(x.children) != 1:
                break
            base = x.start // B
            fresh = False
            for mine, k in zip(x.extra, keep, strict=True):
                if k is not None:
                    for i in range(min(k - base, len(mine))):
                        fresh |= mine[i] != null and mine[i] not in self.stale
                        self._make_stale(x, mine[i])
            if depth and not fresh and all(b == null or b in self.stale for e in x.extra for b in e):
                break  # stale whole already: the path above was made stale by earlier inserts

    def _note_partial(self, node: RadixNode) -> None:
        filled = len(node.tokens) % self.block_size
        if filled and node.blocks:
            self.partial_blocks[node.blocks[-1]] = filled
            for e in node.extra:
                if e[-1] != self.null_block:
                    self.partial_blocks[e[-1]] = filled

    def _forget_partial(self, node: RadixNode) -> None:
        if node.blocks:
            self.partial_blocks.pop(node.blocks[-1], None)
            for e in node.extra:
                self.partial_blocks.pop(e[-1], None)

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cuts `node`'s edge after `at` tokens (a block multiple) and returns the new upper
        half, which takes `node`'s place under the same key; `node` keeps the rest."""
        B = self.block_size
        parent, nb = node.parent, at // B
        self._detach(node)
        mid = RadixNode(
            next(self._ids), parent, node.start, node.tokens[:at], node.blocks[:nb], node.last_access
        )
        mid.host_blocks = node.host_blocks[:nb]
        mid.extra = [e[:nb] for e in node.extra]
        node.extra = [e[nb:] for e in node.extra]
        for e in mid.extra:
            for b in e:
                if b != self.null_block:
                    self._node_of[b] = mid
        mid.lock_ref, mid.hits = node.lock_ref, node.hits
        mid.priority, mid.session = node.priority, node.session
        for b in mid.blocks:
            self._node_of[b] = mid
        parent.children[block_key(mid.tokens[:B])] = mid
        siblings = parent.by_first[mid.tokens[0]]
        siblings[siblings.index(node)] = mid
        node.tokens, node.start = node.tokens[at:], node.start + at
        node.blocks, node.host_blocks = node.blocks[nb:], node.host_blocks[nb:]
        self._link(mid, node, block_key(node.tokens[:B]))
        mid.device_children = int(bool(node.blocks))
        self._attach(node)
        self._attach(mid)
        return mid

    def _remove(self, node: RadixNode) -> None:
        """Takes a childless node out of the tree; its blocks are already released."""
        parent = node.parent
        self._detach(node)
        self._detach(parent)
        self._unlink(node)
        node.parent = None  # out of the tree
        if node.blocks:
            parent.device_children -= 1
        self._attach(parent)

    # ------------------------------------------------------------- host tier

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


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return _common_len(a, 0, b, 0, 64)


def _common_len(
    edge: list[int], i: int, tokens: list[int], j: int, block_size: int, limit: int | None = None
) -> int:
    """Length of the common run of `edge[i:]` and `tokens[j:]` (at most `limit`), compared in
    C-level slices: from a block, doubling while they match (a long shared prefix costs a few
    comparisons, not one per block), then halving down to a block around the first mismatch,
    which is found token by token."""
    n = min(len(edge) - i, len(tokens) - j)
    if limit is not None:
        n = min(n, limit)
    k, step, growing = 0, block_size, True
    while k < n:
        step = min(step, n - k)
        if edge[i + k : i + k + step] == tokens[j + k : j + k + step]:
            k += step
            step = step * 2 if growing else step
            continue
        if step > block_size:
            step, growing = step // 2, False
            continue
        while edge[i + k] == tokens[j + k]:
            k += 1
        return k
    return k
