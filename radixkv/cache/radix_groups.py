"""KV groups 1.. in the radix cache: the blocks of sliding-window layer groups beside group 0.

Group 0's blocks decide every node's residency and eviction; the other groups' blocks follow
their node, and a sliding group's blocks that no window of a path's end reads become stale:
cached still, counted as free, released before anything else is evicted (`set_groups` states
the rules).
"""

from __future__ import annotations

from collections.abc import Iterable

from radixkv.cache.kv_groups import sliding_keep_from
from radixkv.cache.radix_tree import RadixNode


class RadixGroups:
    """Mixed into `RadixCache`, which makes `windows`, `null_block`, `stale` and `_stale_tick`."""

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

    @property
    def num_stale(self) -> int:
        """Stale group blocks only the tree references: what releasing them all would free."""
        return sum(self.pool.refcount(b) == 1 for b in self.stale)

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
                e[i] == null
                for h, e in enumerate(node.extra)
                if h != g and windows[h] is not None and w is not None and windows[h] >= w
            )
            order.append((not dead, self.stale[block], node.start // B + i, node, node.extra[g], i))
        order.sort(key=lambda t: t[:3])
        return [(node, blocks, i) for *_, node, blocks, i in order]

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
