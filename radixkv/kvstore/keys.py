"""Content keys of stored blocks: a hash chain over the tokens, in a namespace per model and layout.

Block i's key is `xxh3_128(key(i-1) + tokens of block i)`, and block 0 chains from the namespace
key, so a key names a block's tokens and every token before it, as the KV of a causal model
depends on them all. The namespace hashes what else the KV depends on: the model (its name and
config), the dtype, the block size, the layout version of a block's bytes, and the cache salt
(requests of different salts never share a block, in memory or in the store). 128 bits: a
collision among 10^12 stored blocks has odds below 10^-14.
"""

from __future__ import annotations

from array import array

import xxhash

# Bump when a stored block's byte layout changes ([K/V, layer, slot, head, dim] in the cache dtype).
LAYOUT_VERSION = 1


class KeySpace:
    """The key function of one engine's blocks. `fingerprint` names the model and its config."""

    def __init__(self, fingerprint: str, dtype: str, block_size: int) -> None:
        self.block_size = block_size
        self._base = f"radixkv-kv/v{LAYOUT_VERSION}/{fingerprint}/{dtype}/block{block_size}"
        self._roots: dict[str | None, bytes] = {}

    def root(self, salt: str | None = None) -> bytes:
        """The key block 0 chains from, for `salt` (None or "": unsalted)."""
        salt = salt or None
        key = self._roots.get(salt)
        if key is None:
            key = xxhash.xxh3_128_digest(f"{self._base}/salt={salt!r}".encode())
            self._roots[salt] = key
        return key

    def block_keys(self, tokens: list[int], num_blocks: int, salt: str | None = None) -> list[bytes]:
        """Keys of the first `num_blocks` full blocks of `tokens` (at most the full blocks there are)."""
        B = self.block_size
        num_blocks = min(num_blocks, len(tokens) // B)
        data = array("q", tokens[: num_blocks * B]).tobytes()
        step = 8 * B
        key = self.root(salt)
        keys = []
        for i in range(num_blocks):
            key = xxhash.xxh3_128_digest(key + data[i * step : (i + 1) * step])
            keys.append(key)
        return keys
