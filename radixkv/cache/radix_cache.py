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
and `protected_size` (in blocks) are kept exact as locks move, so admission can trust them.
Eviction trims unlocked leaves from their tail, least valuable first under a pluggable policy.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator
from typing import NamedTuple

import xxhash
from sortedcontainers import SortedList

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.eviction import LRU, EvictionPolicy


class RadixNode:
    __slots__ = (
        "blocks",
        "by_first",
        "children",
        "hits",
        "id",
        "last_access",
        "lock_ref",
        "parent",
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
        self.blocks = blocks
        self.children: dict[int, RadixNode] = {}  # xxhash of the child's first block of tokens
        self.by_first: dict[int, list[RadixNode]] = {}  # the child's first token -> children
        self.lock_ref = 0
        self.last_access = last_access
        self.hits = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def __repr__(self) -> str:
        span = f"[{self.start}, {self.end})"
        return f"RadixNode(id={self.id}, {span}, blocks={self.blocks}, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    """The longest cached prefix of a query.

    `blocks` covers `ceil(num_tokens / block_size)` blocks. When `num_tokens` is not a multiple
    of the block size the last block is only partly matched: share it, and the first write
    copies it. `node` ends exactly at the last whole matched block; lock it to keep those blocks.
    """

    node: RadixNode
    num_tokens: int
    blocks: list[int]


class InsertResult(NamedTuple):
    """`num_cached`: leading tokens already cached before the insert. `redundant`: the caller's
    blocks that the cache did not take because it holds the same KV already; they are freed
    when the caller drops its references."""

    num_cached: int
    redundant: list[int]


def block_key(tokens: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(array("q", tokens).tobytes())


class RadixCache:
    def __init__(self, pool: BlockPool, policy: EvictionPolicy | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.policy = policy or LRU()
        self._ids = itertools.count()
        self._clock = 0
        self.root = RadixNode(next(self._ids), None, 0, [], [], 0)
        self.root.lock_ref = 1  # the root is never evictable
        self._leaves = SortedList(key=self._leaf_key)  # unlocked leaves, next to evict first
        self.evictable_size = 0  # blocks of unlocked nodes
        self.protected_size = 0  # blocks of locked nodes
        self.num_evicted = 0
        self._node_of: dict[int, RadixNode] = {}  # cached block -> the node holding it
        # The last block of each leaf that ends inside it, with its token count, and the empty
        # slots of all of them: every other cached block is full, so a usage meter needs only
        # these (KVCacheManager.slot_usage).
        self.partial_blocks: dict[int, int] = {}
        self.partial_empty_slots = 0

    # ----------------------------------------------------------------- lookups

    def match_prefix(self, tokens: list[int]) -> MatchResult:
        """Longest cached prefix of `tokens`, token-granular. Splits a node so that the result's
        node ends at the last whole matched block (exact locking)."""
        self._clock += 1
        node, pos, child, common = self._walk(tokens, touch=True)
        matched = pos + common
        full = matched - matched % self.block_size
        partial: RadixNode | None = None
        if child is not None:
            if full > pos:
                node = self._split(child, full - pos)
                self._touch(node)
            if matched > full:
                partial = child
        elif pos > full:  # a leaf that ends inside its last block, matched whole
            partial = node
            node = self._split(node, full - node.start) if full > node.start else node.parent
        blocks = self._path_blocks(node)
        if partial is not None:
            blocks.append(partial.blocks[0])
        return MatchResult(node, matched, blocks)

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` are cached; changes nothing (no split, no touch)."""
        _, pos, _, common = self._walk(tokens, touch=False)
        return pos + common

    def insert(self, tokens: list[int], blocks: list[int]) -> InsertResult:
        """Caches `tokens` whose KV is in `blocks` (at least `ceil(len(tokens) / block_size)`).

        The cache takes its own reference on each block it keeps; the caller keeps its own and
        drops them as usual. Where the cache already holds a prefix, its blocks stay and the
        caller's are reported redundant. A leaf that ends inside a block and is extended takes
        the caller's fuller copy of that block in place of its own.
        """
        n = len(tokens)
        nb = -(-n // self.block_size)
        if len(blocks) < nb:
            raise ValueError(f"{n} tokens need {nb} blocks, got {len(blocks)}")
        self._clock += 1
        node, pos, child, common = self._walk(tokens, touch=True)
        num_cached = pos + common
        B = self.block_size
        if pos < n:
            if child is None and pos % B:
                self._extend_leaf(node, tokens[pos:], blocks[pos // B : nb])
            elif child is None:
                self._add_leaf(node, tokens[pos:], blocks[pos // B : nb])
            elif pos + common < n:
                at = common - common % B
                parent = node
                if at:
                    parent = self._split(child, at)
                    self._touch(parent)
                self._add_leaf(parent, tokens[pos + at :], blocks[(pos + at) // B : nb])
        cached = self._blocks_along(tokens, nb)
        redundant = [b for b, c in zip(blocks[:nb], cached, strict=False) if b != c]
        return InsertResult(num_cached, redundant)

    # ---------------------------------------------------------- locks, evict

    def inc_lock(self, node: RadixNode) -> None:
        """Protects `node` and its ancestors from eviction; pair with `dec_lock`."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.blocks)
                self.protected_size += len(node.blocks)
                if not node.children:
                    self._leaves.remove(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError(f"{node} is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.blocks)
                self.protected_size -= len(node.blocks)
                if not node.children:
                    self._leaves.add(node)
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Frees blocks from unlocked leaves, trimming each from its tail, until `num_blocks`
        are free or nothing is evictable. Returns how many blocks it freed. A block that a live
        sequence still references loses only the cache's reference and is not counted."""
        freed = 0
        while freed < num_blocks and self._leaves:
            leaf = self._leaves.pop(0)
            take = min(num_blocks - freed, len(leaf.blocks))
            keep = len(leaf.blocks) - take
            for block in leaf.blocks[keep:]:
                freed += self.pool.decref(block)
                del self._node_of[block]
            self.evictable_size -= take
            self.num_evicted += take
            self._forget_partial(leaf)  # its last block is among those taken
            if keep:
                del leaf.blocks[keep:]
                del leaf.tokens[keep * self.block_size :]
                self._leaves.add(leaf)
            else:
                self._remove_leaf(leaf)
        return freed

    # ----------------------------------------------------------- inspection

    def evictable_block(self, block: int) -> bool:
        """Whether `block` is cached in an unlocked node (eviction may take it)."""
        node = self._node_of.get(block)
        return node is not None and node.lock_ref == 0

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
        return [b for node in self.nodes() for b in node.blocks]

    def check_invariants(self) -> None:
        """Structure, keys, sizes and the evictable set agree with a recount from scratch."""
        B = self.block_size
        evictable = protected = 0
        leaves = set()
        partial: dict[int, int] = {}
        seen: set[int] = set()
        for node in self.nodes():
            if node is self.root:
                continue
            p = node.parent
            assert p is not None and node.start == p.end, f"{node} does not start where its parent ends"
            assert node.start % B == 0, f"{node} starts inside a block"
            assert node.tokens, f"{node} has an empty edge"
            assert len(node.blocks) == -(-len(node.tokens) // B), f"{node} has the wrong number of blocks"
            assert not node.children or node.end % B == 0, f"inner {node} ends inside a block"
            assert p.children.get(block_key(node.tokens[:B])) is node, f"{node} is not under its key"
            assert node in p.by_first[node.tokens[0]], f"{node} is missing from its first-token index"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), f"{node} lock"
            for b in node.blocks:
                assert b not in seen, f"block {b} is held by two nodes"
                assert self._node_of.get(b) is node, f"block {b} is not mapped to {node}"
                assert self.pool.refcount(b) >= 1, f"cached block {b} is free"
                seen.add(b)
            if len(node.tokens) % B:
                partial[node.blocks[-1]] = len(node.tokens) % B
            if node.lock_ref:
                protected += len(node.blocks)
            else:
                evictable += len(node.blocks)
                if not node.children:
                    leaves.add(node.id)
        assert len(self._node_of) == len(seen), "the block map holds blocks no node has"
        for node in self.nodes():
            assert sum(len(v) for v in node.by_first.values()) == len(node.children), f"{node} index"
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"sizes {self.evictable_size}/{self.protected_size}, recount {evictable}/{protected}"
        )
        assert {n.id for n in self._leaves} == leaves, "evictable leaf set is stale"
        assert partial == self.partial_blocks, "partly filled cached blocks are miscounted"
        assert self.partial_empty_slots == sum(B - f for f in partial.values()), "empty slots miscounted"
        keys = [self._leaf_key(n) for n in self._leaves]
        assert keys == sorted(keys), "evictable leaves are out of order"

    # ------------------------------------------------------------ internals

    def _leaf_key(self, node: RadixNode) -> tuple:
        return (self.policy.key(node), node.id)

    def nodes(self) -> Iterator[RadixNode]:
        """Every node, the root included, in no particular order."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _walk(self, tokens: list[int], touch: bool) -> tuple[RadixNode, int, RadixNode | None, int]:
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
                self._touch(child)
            node, pos = child, pos + common
        return node, pos, None, 0

    def _child_for(self, node: RadixNode, tokens: list[int], pos: int) -> tuple[RadixNode | None, int]:
        B = self.block_size
        head = tokens[pos : pos + B]
        child = node.children.get(block_key(head))
        if child is not None and child.tokens[:B] == head:
            return child, len(head) + _common_len(child.tokens, len(head), tokens, pos + len(head), B)
        best, best_len = None, 0
        for cand in node.by_first.get(tokens[pos], ()):
            k = _common_len(cand.tokens, 0, tokens, pos, B, limit=B)
            if k > best_len:
                best, best_len = cand, k
        return best, best_len

    def _touch(self, node: RadixNode) -> None:
        in_set = node.lock_ref == 0 and not node.children
        if in_set:
            self._leaves.remove(node)
        node.last_access = self._clock
        node.hits += 1
        if in_set:
            self._leaves.add(node)

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

    def _add_leaf(self, parent: RadixNode, tokens: list[int], blocks: list[int]) -> None:
        key = block_key(tokens[: self.block_size])
        if key in parent.children:
            return  # a 64-bit hash collision: leave this run uncached rather than risk mixing KV
        if not parent.children and parent is not self.root and parent.lock_ref == 0:
            self._leaves.remove(parent)
        node = RadixNode(next(self._ids), parent, parent.end, tokens, list(blocks), self._clock)
        self._link(parent, node, key)
        for b in blocks:
            self.pool.incref(b)
            self._node_of[b] = node
        self.evictable_size += len(blocks)
        self._leaves.add(node)
        self._note_partial(node)

    def _extend_leaf(self, leaf: RadixNode, tokens: list[int], blocks: list[int]) -> None:
        """`leaf` ends inside its last block; `blocks[0]` holds that block's tokens and more."""
        B = self.block_size
        key = block_key((leaf.tokens + tokens[:B])[:B])  # the first block of tokens may grow
        sibling = leaf.parent.children.get(key)
        if sibling is not None and sibling is not leaf:
            return  # a hash collision, as in _add_leaf
        self._leaves.remove(leaf)
        self._unlink(leaf)
        self._forget_partial(leaf)
        if blocks[0] != leaf.blocks[-1]:
            self.pool.incref(blocks[0])
            self.pool.decref(leaf.blocks[-1])
            del self._node_of[leaf.blocks[-1]]
            leaf.blocks[-1] = blocks[0]
            self._node_of[blocks[0]] = leaf
        for b in blocks[1:]:
            self.pool.incref(b)
            self._node_of[b] = leaf
        leaf.blocks.extend(blocks[1:])
        leaf.tokens.extend(tokens)
        self.evictable_size += len(blocks) - 1
        self._link(leaf.parent, leaf, key)
        self._leaves.add(leaf)
        self._note_partial(leaf)

    def _note_partial(self, leaf: RadixNode) -> None:
        filled = len(leaf.tokens) % self.block_size
        if filled:
            self.partial_blocks[leaf.blocks[-1]] = filled
            self.partial_empty_slots += self.block_size - filled

    def _forget_partial(self, leaf: RadixNode) -> None:
        filled = self.partial_blocks.pop(leaf.blocks[-1], None) if leaf.blocks else None
        if filled is not None:
            self.partial_empty_slots -= self.block_size - filled

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cuts `node`'s edge after `at` tokens (a block multiple) and returns the new upper
        half, which takes `node`'s place under the same key; `node` keeps the rest."""
        B = self.block_size
        parent, nb = node.parent, at // B
        mid = RadixNode(
            next(self._ids), parent, node.start, node.tokens[:at], node.blocks[:nb], node.last_access
        )
        mid.lock_ref, mid.hits = node.lock_ref, node.hits
        for b in mid.blocks:
            self._node_of[b] = mid
        parent.children[block_key(mid.tokens[:B])] = mid
        siblings = parent.by_first[mid.tokens[0]]
        siblings[siblings.index(node)] = mid
        node.tokens, node.blocks, node.start = node.tokens[at:], node.blocks[nb:], node.start + at
        self._link(mid, node, block_key(node.tokens[:B]))
        return mid

    def _remove_leaf(self, leaf: RadixNode) -> None:
        self._forget_partial(leaf)
        parent = leaf.parent
        self._unlink(leaf)
        if not parent.children and parent is not self.root and parent.lock_ref == 0:
            self._leaves.add(parent)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return _common_len(a, 0, b, 0, 64)


def _common_len(
    edge: list[int], i: int, tokens: list[int], j: int, block_size: int, limit: int | None = None
) -> int:
    """Length of the common run of `edge[i:]` and `tokens[j:]` (at most `limit`), compared a
    block at a time so long equal runs cost one C-level comparison per block."""
    n = min(len(edge) - i, len(tokens) - j)
    if limit is not None:
        n = min(n, limit)
    k = 0
    while k < n:
        step = min(block_size, n - k)
        if edge[i + k : i + k + step] == tokens[j + k : j + k + step]:
            k += step
            continue
        while edge[i + k] == tokens[j + k]:
            k += 1
        return k
    return k
