"""A stored block's bytes: a header naming its key, length and checksum, then the KV payload.

`MAGIC (4) | payload length (u64) | xxh3_64 of key + payload (u64) | key (16) | payload`. The
key inside the entry guards against an entry stored or renamed under another key; the checksum
against a flipped bit; the length against a truncated write. Any of them wrong: `CorruptEntry`,
which the store counts and treats as a miss.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"RKV1"
_HEADER = struct.Struct("<4sQQ16s")
HEADER_SIZE = _HEADER.size


class CorruptEntry(ValueError):
    """A stored entry that does not check out: damaged, truncated, or not the key's."""


def encode_entry(key: bytes, payload: bytes) -> bytes:
    checksum = xxhash.xxh3_64_intdigest(key + payload)
    return _HEADER.pack(MAGIC, len(payload), checksum, key) + payload


def decode_entry(key: bytes, entry: bytes, payload_size: int | None = None) -> bytes:
    """The payload of `entry`, stored under `key`; `payload_size`, when given, is the only size
    accepted. Raises CorruptEntry."""
    if len(entry) < HEADER_SIZE:
        raise CorruptEntry(f"entry of {len(entry)} bytes is shorter than its header")
    magic, size, checksum, own_key = _HEADER.unpack_from(entry)
    payload = entry[HEADER_SIZE:]
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {magic!r}")
    if own_key != key:
        raise CorruptEntry("entry holds another key")
    if size != len(payload) or (payload_size is not None and size != payload_size):
        raise CorruptEntry(f"payload is {len(payload)} bytes, header says {size}, expected {payload_size}")
    if xxhash.xxh3_64_intdigest(key + payload) != checksum:
        raise CorruptEntry("checksum mismatch")
    return payload
