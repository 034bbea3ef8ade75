"""The router's estimate of what one replica's prefix cache holds.

A `PrefixIndex` is a radix tree of the token sequences routed to one replica, built from the
cache's own classes (`BlockPool`, `RadixCache`, `KVCacheManager`) at the replica's block size and
block capacity, evicting least recently used first like the replica's default policy.

Why aging and not eviction reports from the replicas: the router sees every request a replica
gets, in the order it gets them, so an LRU tree of the same capacity fed the same sequences
evicts (nearly) the same prefixes the replica does, with no channel back from the replicas, no
extra message per eviction, and nothing to change in the engine; `simulate` runs the same index
with no server at all. It drifts only where the replica sees what the router does not: the
reply's tokens (recorded once a reply comes back, when the caller has them), blocks pinned by
requests still running, and a restart, which empties the replica's cache (call `clear`). A drift
costs a worse route, never a wrong answer: the replica's own cache decides what is reused.
"""

from __future__ import annotations

from radixkv.cache import BlockPool, KVCacheManager, OutOfBlocks, RadixCache, make_policy
from radixkv.cache.kv_cache_manager import NO_DATA


class PrefixIndex:
    """Bounded to `capacity_blocks` blocks of `block_size` tokens; `eviction` names the
    replica's policy (`lru` by default)."""

    def __init__(self, capacity_blocks: int, block_size: int, eviction: str = "lru") -> None:
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.eviction = eviction
        self.clear()

    def clear(self) -> None:
        """Forgets everything: the replica restarted with an empty cache."""
        pool = BlockPool(self.capacity_blocks, self.block_size)
        self._kv = KVCacheManager(pool, RadixCache(pool, make_policy(self.eviction)))

    def match(self, tokens: list[int]) -> int:
        """Leading tokens of `tokens` the replica is estimated to hold; changes nothing."""
        return self._kv.cache.cached_prefix_len(tokens)

    def record(self, tokens: list[int]) -> None:
        """`tokens` were sent to the replica (a prompt, or a prompt with its reply): they are
        now its most recently used sequence, evicting the least recently used to make room. A
        sequence longer than the whole capacity is not recorded, as the replica cannot keep it."""
        kv = self._kv
        table = kv.admit(tokens)
        try:
            kv.reserve([(table, len(tokens) - table.num_tokens)])
        except OutOfBlocks:
            kv.release(table)
        else:
            kv.run_transfers(NO_DATA)  # only references move: there is no KV data here
            kv.cache_finished(table, tokens)

    @property
    def num_cached_blocks(self) -> int:
        return self._kv.cache.num_cached_blocks

    def check_invariants(self) -> None:
        self._kv.check_invariants([])
