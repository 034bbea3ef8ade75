"""Which unreferenced cached leaf goes first when blocks run short.

A policy is a sort key over the radix tree's evictable leaves: the smallest key is evicted
first. The tree keeps the leaves in a `SortedList` under that key, so a leaf's key must not
change while it sits there: the tree takes a leaf out, updates its statistics (`last_access`, a
logical clock of matches and inserts; `hits`, how often it was on a matched path; `session`, the
chat session that last touched it), calls `touched`, and puts it back. A policy with state of its
own (GDSF's inflation) keeps it in `priority`, set in `touched`, and learns of each eviction
through `evicted`. Policies never change the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixNode


class EvictionPolicy:
    """The base of every policy: `key` is required, the hooks are optional."""

    name: str
    keys_blocks = False  # whether a leaf's key is its last block's own: then trim one at a time

    def key(self, node: RadixNode) -> Any:
        """Sort key of an evictable leaf; the smallest is evicted first. It may read only what
        changes through `touched` (and `RadixCache.set_session_live`, which re-keys)."""
        raise NotImplementedError

    def touched(self, node: RadixNode) -> None:
        """`node` was created, matched or extended; its statistics are already updated."""

    def evicted(self, node: RadixNode) -> None:
        """The tree is about to evict blocks from the leaf `node` (the one with the smallest key)."""

    def trimmed(self, node: RadixNode) -> None:
        """Eviction cut blocks off the tail of the leaf `node`, which stays evictable."""


class LRU(EvictionPolicy):
    """Least recently used first: the leaf whose last match or insert is oldest."""

    name = "lru"

    def key(self, node: RadixNode) -> int:
        return node.last_access


class LFU(EvictionPolicy):
    """Least frequently used first, least recently used among equals."""

    name = "lfu"

    def key(self, node: RadixNode) -> tuple[int, int]:
        return (node.hits, node.last_access)


class GDSF(EvictionPolicy):
    """Greedy-Dual-Size-Frequency: `priority = L + frequency * cost / size`, smallest first.

    `L` (inflation) is the priority of the last evicted leaf, so a leaf that was hot long ago
    ages out once newer leaves overtake it: plain LFU's weakness. Size is one block (eviction
    trims leaves block by block); the cost of a block is what recomputing it takes, its MLP part
    (1) plus its attention over the context before it (`end / attention_tokens`), so deep blocks
    of long prompts, the dearest to recompute, are kept a little longer. Ties go to recency.
    """

    name = "gdsf"

    def __init__(self, attention_tokens: int = 32768) -> None:
        self.inflation = 0.0
        self.attention_tokens = attention_tokens

    def key(self, node: RadixNode) -> tuple[float, int]:
        return (node.priority, node.last_access)

    def touched(self, node: RadixNode) -> None:
        cost = 1.0 + node.end / self.attention_tokens
        node.priority = self.inflation + (node.hits + 1) * cost

    def evicted(self, node: RadixNode) -> None:
        self.inflation = max(self.inflation, node.priority)


class SessionAware(EvictionPolicy):
    """Blocks of live chat sessions outrank those of one-off requests and closed sessions.

    A leaf belongs to the session that last touched it. Among leaves of the same class (live, or
    not), the least recently used goes first, so a live session's blocks are not pinned forever:
    once only live sessions' leaves are left, they are evicted by recency too.
    """

    name = "session"

    def __init__(self) -> None:
        self.live: set[str] = set()

    def key(self, node: RadixNode) -> tuple[bool, int]:
        return (node.session in self.live, node.last_access)


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU, GDSF, SessionAware)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {name!r}") from None
