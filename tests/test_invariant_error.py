"""`check_invariants()` raises `radixkv.InvariantError` naming what broke, under `python -O` too
(where `assert` statements are stripped and checked nothing)."""

from __future__ import annotations

import subprocess

import pytest

from radixkv import InvariantError
from radixkv.cache import BlockPool, KVCacheManager, RadixCache
from radixkv.interpreter import python_argv

CORRUPT_AND_CHECK = """
from radixkv.cache import BlockPool, KVCacheManager, RadixCache
from radixkv.errors import InvariantError
pool = BlockPool(8, 4)
cache = RadixCache(pool)
kv = KVCacheManager(pool, cache)
table = kv.admit([1, 2, 3, 4, 5])
kv.reserve([(table, 5)])
kv.cache_finished(table, [1, 2, 3, 4, 5])
kv.check_invariants([])
pool.incref(cache.referenced_blocks()[0])  # a reference nobody holds
try:
    kv.check_invariants([])
except InvariantError as error:
    print("caught:", error)
else:
    print("missed")
"""


def test_a_corrupted_pool_is_caught_even_under_python_dash_o():
    argv = python_argv("-O", "-c", CORRUPT_AND_CHECK)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith("caught: block ") and "refcount 2, but 1 references" in out.stdout, out


def test_invariant_errors_name_the_broken_book():
    pool = BlockPool(8, 4)
    cache = RadixCache(pool)
    kv = KVCacheManager(pool, cache)
    table = kv.admit([1, 2, 3, 4, 5, 6])
    kv.reserve([(table, 6)])
    kv.cache_finished(table, [1, 2, 3, 4, 5, 6])
    cache.evictable_size += 1  # a size that no longer matches a recount
    with pytest.raises(InvariantError, match="sizes"):
        kv.check_invariants([])
    assert issubclass(InvariantError, AssertionError)
