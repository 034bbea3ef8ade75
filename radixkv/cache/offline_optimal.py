"""The offline optimum for `radixkv simulate`: evict what is used again furthest in the future.

Belady's rule on the radix tree. It knows every request to come, so it only exists where the
whole trace is known in advance (`simulate --eviction optimal`), never in the engine. A block is
used by a request whose prompt contains the block's whole prefix; the tree evicts leaves only
(a node after its children) and trims them from their tail, so a leaf's key is the next use of
its deepest block. A deeper block is never used before the blocks above it, so the rule never
wants a parent gone before its children: tree order costs the bound nothing.

Uses are recorded at block boundaries. A leaf that holds only a partly filled block is keyed by
its parent's boundary, an earlier use than its own: the bound keeps such leaves a little longer
than it needs to, so it is exact for block-aligned prefixes (hash-id traces) and slightly low
for workloads whose replies end inside blocks.
"""

from __future__ import annotations

import bisect
from array import array
from typing import TYPE_CHECKING

import xxhash

from radixkv.cache.eviction import EvictionPolicy

if TYPE_CHECKING:
    from radixkv.cache.radix_tree import RadixNode

NEVER = float("inf")


class OfflineOptimal(EvictionPolicy):
    """Furthest next use first. `prompts` are the requests' prompts in serving order; call
    `advance(i)` before serving request `i`."""

    name = "optimal"
    keys_blocks = True  # the blocks of one edge may be used again at different times

    def __init__(self, prompts: list[list[int]], block_size: int) -> None:
        self.block_size = block_size
        self.now = -1
        self._uses: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            h = xxhash.xxh3_64()
            for start in range(0, len(prompt) - block_size + 1, block_size):
                h.update(array("q", prompt[start : start + block_size]).tobytes())
                self._uses.setdefault(h.intdigest(), []).append(i)

    def advance(self, request_index: int) -> None:
        self.now = request_index

    def key(self, node: RadixNode) -> float:
        return node.priority

    def touched(self, node: RadixNode) -> None:
        node.priority = -self._next_use(node)

    def trimmed(self, node: RadixNode) -> None:
        node.priority = -self._next_use(node)

    def _next_use(self, node: RadixNode) -> float:
        """Index of the first request after now that uses `node`'s deepest whole block."""
        end = node.end - node.end % self.block_size
        if end <= node.start:  # only a partly filled block: its parent's boundary stands in
            end = node.start
        if end == 0:
            return NEVER
        parts = []
        while node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        path = [t for part in reversed(parts) for t in part]
        uses = self._uses.get(xxhash.xxh3_64_intdigest(array("q", path[:end]).tobytes()), ())
        k = bisect.bisect_right(uses, self.now)
        return uses[k] if k < len(uses) else NEVER
