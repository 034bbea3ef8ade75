"""The KV store: a third tier behind host memory that outlives the process and that replicas share.

A full block's KV is stored under a content key (`KeySpace.block_keys`): a hash chain over its
tokens (as the radix tree keys them: salted for a request with a `cache_salt`) and every token
before it, seeded with the model, dtype, block size and KV layout version, so two engines that
would compute the same KV find it under the same key and nothing else ever does. Entries carry
a checksum (`entry`); a damaged or truncated one is a miss. Backends (`backends`): `file://DIR`
and `redis://host:port/db`. `KVStore` runs every write and read on background threads, so
neither ever blocks an engine step.

Nothing here imports torch: the engine's model runner turns blocks into bytes and back.
"""

from radixkv.kvstore.backends import Backend, FileBackend, MemoryBackend, RedisBackend, open_backend
from radixkv.kvstore.entry import CorruptEntry, decode_entry, encode_entry
from radixkv.kvstore.keys import LAYOUT_VERSION, KeySpace
from radixkv.kvstore.store import KVStore, StoredBlock, StoredRun, StoreLookup

__all__ = [
    "LAYOUT_VERSION",
    "Backend",
    "CorruptEntry",
    "FileBackend",
    "KVStore",
    "KeySpace",
    "MemoryBackend",
    "RedisBackend",
    "StoreLookup",
    "StoredBlock",
    "StoredRun",
    "decode_entry",
    "encode_entry",
    "open_backend",
]
