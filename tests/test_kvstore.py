"""The KV store without a model: keys, entries, the backends and the client's queues and failures."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time

import pytest
from redis_server import redis_url  # noqa: F401  (a fixture)

from radixkv.cache.salt import salt_offset, salted
from radixkv.kvstore import (
    CorruptEntry,
    FileBackend,
    KeySpace,
    KVStore,
    MemoryBackend,
    decode_entry,
    encode_entry,
    open_backend,
)

B = 4


def keys_of(tokens, fingerprint="m"):
    return KeySpace(fingerprint, "float32", B).block_keys(tokens, len(tokens))


def test_a_key_names_its_block_and_every_token_before_it():
    base = list(range(16))
    keys = keys_of(base)
    assert len(keys) == 4 and len(set(keys)) == 4 and all(len(k) == 16 for k in keys)
    assert keys_of(base[:13]) == keys[:3]  # only full blocks, and a prefix's keys are a prefix
    for i in range(16):  # a change anywhere changes that block's key and every later one
        other = list(base)
        other[i] += 100
        changed = keys_of(other)
        assert changed[: i // B] == keys[: i // B]
        assert all(a != b for a, b in zip(changed[i // B :], keys[i // B :], strict=True))
    assert not set(keys) & set(keys_of(salted(base, salt_offset("tenant-a"))))  # as the cache keys it
    assert not set(keys) & set(keys_of(base, fingerprint="another model"))
    assert not set(keys) & set(KeySpace("m", "bfloat16", B).block_keys(base, 4))


def test_an_entry_with_any_byte_flipped_truncated_or_moved_is_refused():
    key, other = keys_of(list(range(8)))
    payload = bytes(range(200))
    entry = encode_entry(key, payload)
    assert decode_entry(key, entry, len(payload)) == payload
    for i in range(len(entry)):
        bad = bytearray(entry)
        bad[i] ^= 0x10
        with pytest.raises(CorruptEntry):
            decode_entry(key, bytes(bad), len(payload))
    for cut in (0, 10, len(entry) - len(payload), len(entry) - 1):
        with pytest.raises(CorruptEntry):
            decode_entry(key, entry[:cut], len(payload))
    with pytest.raises(CorruptEntry):
        decode_entry(other, entry)
    with pytest.raises(CorruptEntry):  # whole, but not the size this engine's blocks have
        decode_entry(key, entry, len(payload) + 1)


def test_file_backend_round_trip_leaves_no_temporary_files(tmp_path):
    backend = open_backend(f"file://{tmp_path}/store")
    a, b, c = keys_of(list(range(12)))
    backend.put([(a, b"aa"), (b, b"bbb")])
    assert backend.exists([a, b, c]) == [True, True, False]
    assert backend.get([a, c, b]) == [b"aa", None, b"bbb"]
    backend.put([(a, b"AA")])  # rewritten whole
    assert backend.get([a]) == [b"AA"]
    names = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert len(names) == 2 and not [n for n in names if n.startswith(".tmp")]


def test_file_backend_evicts_the_least_recently_used_past_its_cap(tmp_path):
    backend = FileBackend(tmp_path, max_bytes=10_000)
    keys = keys_of(list(range(4 * 12)))
    for i, key in enumerate(keys[:8]):
        backend.put([(key, bytes(1000))])
        os.utime(backend.path(key), ns=(i * 10**9, i * 10**9))  # written in order, oldest first
    backend.get([keys[0]])  # read: the newest now
    backend.put([(k, bytes(1000)) for k in keys[8:]])  # 12,000 bytes: trimmed to 9,000
    present = backend.exists(keys)
    kept = [k for k, p in zip(keys, present, strict=True) if p]
    assert sum(len(e) for e in backend.get(kept)) <= 9000
    assert present[0], "the block read last was evicted"
    assert not any(present[1:4]), "the oldest blocks were kept"
    assert all(present[8:]), "the newest writes were evicted"


def _write_many(root: str, keys: list[bytes], marker: int) -> None:
    backend = FileBackend(root)
    for _ in range(20):
        backend.put([(k, encode_entry(k, bytes([marker]) * 4000)) for k in keys])


def test_file_backend_is_safe_for_several_processes_writing_the_same_keys(tmp_path):
    keys = keys_of(list(range(4 * 6)))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), keys, m)) for m in (1, 2)]
    for p in procs:
        p.start()
    reader = FileBackend(tmp_path)
    seen = 0
    while any(p.is_alive() for p in procs):  # a reader never sees half an entry
        for key, entry in zip(keys, reader.get(keys), strict=True):
            if entry is not None:
                payload = decode_entry(key, entry, 4000)
                assert payload in (bytes([1]) * 4000, bytes([2]) * 4000)
                seen += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert all(decode_entry(k, e, 4000) for k, e in zip(keys, reader.get(keys), strict=True))


class GatedBackend(MemoryBackend):
    """Puts wait for `gate`; every call raises while `down` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("store is down")

    def exists(self, keys):
        self._check()
        return super().exists(keys)

    def get(self, keys):
        self._check()
        return super().get(keys)

    def put(self, items):
        self.gate.wait(30)
        self._check()
        super().put(items)


def make_store(backend, **kwargs) -> KVStore:
    return KVStore(backend, KeySpace("m", "float32", B), payload_size=3, **kwargs)


def resolve(store: KVStore, lookup, start: int = 0, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (run := store.poll(lookup, start)) is None:
        assert time.monotonic() < deadline, "the lookup never resolved"
        store.wait(0.05)
    return run


def test_a_full_write_queue_drops_and_counts_and_close_flushes_the_rest():
    backend = GatedBackend()
    store = make_store(backend, max_pending_blocks=4)
    tokens = list(range(4 * 6))
    keys = store.keyspace.block_keys(tokens, 6)
    assert store.has_room(4)
    store.save(keys[:4], lambda: [b"abc"] * 4)
    assert not store.has_room(2)  # the writer is stuck on the gate: the queue is full
    assert store.metrics()["kv_store_dropped_writes"] == 2
    assert store.metrics()["kv_store_write_queue_blocks"] == 4
    backend.gate.set()
    store.close()
    m = store.metrics()
    assert m["kv_store_written_blocks"] == 4 and m["kv_store_write_queue_blocks"] == 0
    fresh = make_store(backend)
    run = resolve(fresh, fresh.lookup(tokens))
    assert [b.payload for b in run.blocks] == [b"abc"] * 4 and run.first_block == 0


def test_a_lookup_fetches_only_the_run_that_continues_the_match():
    backend = MemoryBackend()
    store = make_store(backend)
    tokens = list(range(4 * 6))
    keys = store.keyspace.block_keys(tokens, 6)
    backend.put([(k, encode_entry(k, b"xyz")) for i, k in enumerate(keys) if i != 4])
    lookup = store.lookup(tokens)
    run = resolve(store, lookup, start=2)  # blocks 0 and 1 are in memory already
    assert run.first_block == 2 and len(run.blocks) == 2  # 2 and 3; 4 is missing, so 5 is no use
    m = store.metrics()
    assert (m["kv_store_hit_blocks"], m["kv_store_miss_blocks"]) == (2, 2)


def test_an_existence_check_still_running_at_admission_goes_on_to_the_fetch():
    """The first poll finds the existence check running: it leaves the tree's match with it, and
    the reader thread fetches from there as soon as the check ends, with no second poll (one
    handoff between threads before admission instead of two)."""
    backend = MemoryBackend()
    store = make_store(backend)
    tokens = list(range(4 * 5))
    keys = store.keyspace.block_keys(tokens, 5)
    backend.put([(k, encode_entry(k, b"xyz")) for k in keys])
    checked = threading.Event()
    exists = backend.exists
    backend.exists = lambda keys: (checked.wait(30), exists(keys))[1]
    lookup = store.lookup(tokens)
    assert store.poll(lookup, 1) is None  # still checking: the match (block 1) goes with it
    checked.set()
    with store._changed:
        assert store._changed.wait_for(lambda: lookup.done, 10), "the fetch never followed the check"
    assert lookup.run.first_block == 1 and [b.payload for b in lookup.run.blocks] == [b"xyz"] * 4
    assert store.poll(lookup, 1) is lookup.run
    store.close()


def test_a_store_that_is_down_is_a_miss_logged_once(caplog):
    backend = GatedBackend()
    backend.down = True
    backend.gate.set()
    store = make_store(backend, retry_s=60)
    tokens = list(range(4 * 3))
    with caplog.at_level(logging.WARNING, logger="radixkv.kvstore.store"):
        assert resolve(store, store.lookup(tokens)).blocks == []
        for _ in range(3):  # skipped while down: resolved at once, no new error
            assert store.poll(store.lookup(tokens), 0).blocks == []
        assert not store.has_room(1)
    assert store.metrics()["kv_store_errors"] == 1
    assert len([r for r in caplog.records if "failed" in r.message]) == 1
    store.close()


def test_a_slow_store_is_a_miss_after_the_timeout():
    backend = GatedBackend()
    slow = threading.Event()
    backend.exists = lambda keys: (slow.wait(30), [True] * len(keys))[1]
    store = make_store(backend, timeout_s=0.2)
    started = time.monotonic()
    run = resolve(store, store.lookup(list(range(8))))
    assert run.blocks == [] and time.monotonic() - started < 10
    slow.set()
    backend.gate.set()
    store.close()


def test_redis_backend_round_trip_and_a_store_over_it(redis_url):  # noqa: F811
    backend = open_backend(redis_url)
    store = make_store(backend)
    tokens = list(range(4 * 3))
    keys = store.keyspace.block_keys(tokens, 3)
    store.save(keys, lambda: [b"abc", b"def", b"ghi"])
    assert store.flush(10)
    assert backend.exists(keys) == [True] * 3
    other = make_store(open_backend(redis_url))
    run = resolve(other, other.lookup(tokens))
    assert [b.payload for b in run.blocks] == [b"abc", b"def", b"ghi"]
    store.close()
    other.close()


def test_bad_store_urls_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="kv_store"):
        open_backend("s3://bucket")
    with pytest.raises(ValueError, match="kv_store"):
        open_backend(f"file://{tmp_path}?max_bytes=lots")
