"""Content keys of stored blocks: a hash chain over the tokens, in a namespace per model and layout.

Block i's key is `xxh3_128(key(i-1) + tokens of block i)`, and block 0 chains from the namespace
key, so a key names a block's tokens and every token before it, as the KV of a causal model
depends on them all. The namespace hashes what else the KV depends on: the model (its name and
config), the dtype, the block size and the layout version of a block's bytes. The engine keys a
block by its tokens as the radix tree keys them, so a request's `cache_salt` (which shifts its
token ids into a range of its own, `radixkv.cache.salt`) keeps its namespace in the store too.
128 bits: a collision among 10^12 stored blocks has odds below 10^-14.
"""

from __future__ import annotations

from array import array

import xxhash

# Bump when a stored block's byte layout changes ([K/V, layer, slot, head, dim] in the cache dtype).
# 2: a quantized block's scales are one-byte codes (radixkv.kernels.scale_code), not float16.
LAYOUT_VERSION = 2


class KeySpace:
    """The key function of one engine's blocks. `fingerprint` names the model and its config."""

    def __init__(self, fingerprint: str, dtype: str, block_size: int) -> None:
        self.block_size = block_size
        self.root = xxhash.xxh3_128_digest(
            f"radixkv-kv/v{LAYOUT_VERSION}/{fingerprint}/{dtype}/block{block_size}".encode()
        )  # the key block 0 chains from

    def block_keys(self, tokens: list[int], num_blocks: int) -> list[bytes]:
        """Keys of the first `num_blocks` full blocks of `tokens` (at most the full blocks there are)."""
        B = self.block_size
        num_blocks = min(num_blocks, len(tokens) // B)
        data = array("q", tokens[: num_blocks * B]).tobytes()
        step = 8 * B
        key = self.root
        keys = []
        for i in range(num_blocks):
            key = xxhash.xxh3_128_digest(key + data[i * step : (i + 1) * step])
            keys.append(key)
        return keys
