"""Cache namespaces: requests share cached blocks only with requests of the same `cache_salt`.

A prefix cache tells whoever sends a prompt how much of it was cached (`cached_tokens`, and time
to first token), so tenants who share one can read each other's prompts token by token. A salt
gives a request's blocks a namespace of their own. The radix tree is not told about salts at all:
it sees a salted request's tokens shifted into a range no other salt's tokens reach, token `t` as
`t + (h + 1) * 2**TOKEN_BITS` with `h` 41 bits of the salt's xxhash, so runs of two salts never
compare equal and every rule of the tree (matching, copy-on-write, eviction, the host tier, block
hashes) holds as it is. Only the cache's keys change: the KV in the blocks is the real tokens'.
Unsalted requests keep the real token ids, so they share exactly as before.

Two salts share a namespace only if their hashes agree in 41 bits, which an attacker cannot aim
for without knowing the other's salt.
"""

from __future__ import annotations

import xxhash

TOKEN_BITS = 21
"""Token ids below 2**21 (2,097,152) fit under the shift: every vocabulary in use is far smaller."""
_HASH_BITS = 41  # with the shift, a salted id stays below 2**63 (an int64, as block hashes pack it)


def salt_offset(salt: str | None) -> int:
    """What a request with `salt` adds to its token ids in the cache's keys (0 without one)."""
    if salt is None:
        return 0
    h = xxhash.xxh3_64_intdigest(salt.encode()) >> (64 - _HASH_BITS)
    return (h + 1) << TOKEN_BITS


def salted(tokens: list[int], offset: int) -> list[int]:
    """`tokens` as the cache keys them in the namespace of `offset` (`salt_offset`)."""
    return [t + offset for t in tokens] if offset else tokens
