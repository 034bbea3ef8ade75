"""Which unreferenced cached leaf goes first when blocks run short.

A policy is a sort key over the radix tree's evictable leaves: the smallest key is evicted
first. The tree keeps the leaves in a `SortedList` under that key and re-keys a leaf whenever it
is touched, so a policy only reads the statistics the tree keeps on every node (`last_access`,
a logical clock of matches and inserts, and `hits`, how often the node was on a matched path)
and never touches the tree itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixNode


class EvictionPolicy(ABC):
    name: str

    @abstractmethod
    def key(self, node: RadixNode) -> Any:
        """Sort key of an evictable leaf; the smallest is evicted first."""


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


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {name!r}") from None
