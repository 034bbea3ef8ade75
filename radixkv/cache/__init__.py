"""The KV cache's books, in pure Python: which physical block holds what, and who holds it.

A fixed pool of refcounted blocks (`BlockPool`), a radix tree of cached token prefixes over them
(`RadixCache`) with pluggable eviction (`make_policy`) and an optional host tier behind it
(`HostTier`), and the per-sequence holds that admission, growth, copy-on-write, preemption and
release go through (`KVCacheManager`, `BlockTable`), with one table per group of layers of the
same sliding window where a model mixes windows (`kv_groups`). Nothing here
imports torch, transformers or triton: the tensors the blocks index live with the model runner,
so the cache can be simulated or embedded on its own.
"""

from radixkv.cache.block_pool import BlockPool, OutOfBlocks, check_block_size, parse_bytes
from radixkv.cache.block_table import BlockTable
from radixkv.cache.eviction import POLICIES, EvictionPolicy, make_policy
from radixkv.cache.host_tier import HostTier, TransferKind, TransferQueue
from radixkv.cache.kv_cache_manager import NO_DATA, BlockMover, KVCacheManager
from radixkv.cache.kv_groups import KVGroups, kv_groups
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.radix_tree import MatchResult, RadixNode

__all__ = [
    "NO_DATA",
    "POLICIES",
    "BlockMover",
    "BlockPool",
    "BlockTable",
    "EvictionPolicy",
    "HostTier",
    "KVCacheManager",
    "KVGroups",
    "MatchResult",
    "OutOfBlocks",
    "RadixCache",
    "RadixNode",
    "TransferKind",
    "TransferQueue",
    "check_block_size",
    "kv_groups",
    "make_policy",
    "parse_bytes",
]
