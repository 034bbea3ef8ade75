"""The radix tree of cached token prefixes: its nodes, matching, and the edits of its shape.

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

`RadixTree` is the structural part of `RadixCache` (`radix_cache`): every edit of the tree's
shape takes a node out of the evictable sets before it changes and puts it back after
(`RadixEviction._detach` / `_attach`), and keeps the block map (`_node_of`) and the sizes exact.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import NamedTuple

import xxhash


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


class RadixTree:
    """Lookups over the tree and the edits of its shape: walk, split, add and extend a leaf,
    remove a node. Mixed into `RadixCache`, whose `__init__` makes the state it reads (`root`,
    `pool`, `block_size`, `policy`, `_node_of`, `_clock`, `_ids`, the sizes)."""

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` are cached, on either tier; changes nothing."""
        _, pos, _, common = self._walk(tokens, touch=False)
        return pos + common

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
