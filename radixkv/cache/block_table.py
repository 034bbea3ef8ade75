"""One live sequence's hold on KV blocks: the `BlockTable` that `KVCacheManager` hands out.

A table lists the physical block of every `block_size` positions of its sequence, holding a
reference on each, and the cached path it matched, holding a lock on it. Its own module so that
each room of the manager (`kv_prefix`, `kv_growth`, `kv_preemption`, `kv_invariants`) types it
without importing the manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixkv.cache.radix_tree import RadixNode


@dataclass(slots=True, eq=False)
class BlockTable:
    """`blocks[i]` holds positions `[i * block_size, (i + 1) * block_size)`; `num_tokens` slots
    are filled (or being filled this step). `node`, when set, is the locked cached path.
    `session`, when set, is the chat session the sequence belongs to: what it caches is tagged
    with it, for the `session` eviction policy. `key_offset` is its cache namespace
    (`radixkv.cache.salt`): the tokens it matches and caches are keyed shifted by it.
    `extra[g - 1]`: the table of KV group g >= 1 (`radixkv.cache.kv_groups`), as long as
    `blocks`; a sliding group's entries before its window are the manager's null block."""

    blocks: list[int]
    num_tokens: int = 0
    node: RadixNode | None = None
    owner: object = None  # the request holding it
    session: str | None = None
    num_loaded_tokens: int = 0  # of the tokens matched at admission, those loaded from the host
    num_stored_tokens: int = 0  # of the tokens matched at admission, those fetched from the KV store
    key_offset: int = 0
    extra: list[list[int]] = field(default_factory=list)
