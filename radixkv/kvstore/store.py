"""`KVStore`: the engine's client of a store backend. Writes and reads run on background threads;
the engine's step only queues work and polls for results, so the store never blocks a step.

Writes. The model runner copies a newly cached block off the device once and hands its bytes
here (`save`); a writer thread checksums them and puts them in batches. The queue is bounded
(`max_pending_blocks`): when it is full the runner does not copy at all, and the blocks are
counted as dropped writes. `close()` drains the queue first, so what a run computed is in the
store when the process ends cleanly.

Reads, in two steps per request, both on a reader thread:
1. `lookup(tokens)` at submission: the keys of the prompt's full blocks and one batched
   existence check (cheap, and it overlaps the step in flight).
2. At admission (`poll`), once the radix tree's match is known: a fetch of the run of present
   blocks that continues it, and only that run. Blocks the device or host tier hold are never
   read. When the existence check is still running at the first poll, the match is left with
   it and the reader thread goes straight on to the fetch: one handoff between threads, not
   two, before the request can be admitted. The request waits for the fetch (other requests
   are admitted meanwhile) until it lands or `timeout_s` passes; then it goes on with whatever
   arrived.
A backend error is a miss: it is logged once, counted, and the store is skipped for `retry_s`
(every lookup then resolves at once, empty, and writes are dropped), so a store that is down
costs nothing per request. A damaged entry (`CorruptEntry`) is a miss too, counted apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from radixkv.kvstore.backends import Backend
from radixkv.kvstore.entry import CorruptEntry, decode_entry, encode_entry
from radixkv.kvstore.keys import KeySpace

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class StoredBlock:
    """A fetched block's verified payload (compared by identity, so queues never hash the bytes)."""

    payload: bytes


@dataclass(slots=True)
class StoredRun:
    """Consecutive stored blocks of a prompt, from block `first_block` on (perhaps none)."""

    first_block: int
    blocks: list[StoredBlock] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class StoreLookup:
    """One prompt's way through the store: keys, which exist, then a fetched run."""

    tokens: list[int]
    deadline: float
    keys: list[bytes] | None = None
    present: list[bool] | None = None
    run: StoredRun | None = None  # fetched (or given up on: empty)
    fetch_from: int | None = None  # a fetch from this block is in flight
    want_from: int | None = None  # the tree's match when last polled: the fetch to chain
    busy: bool = True  # a background step is in flight
    done: bool = False  # resolved: `run` is final


class KVStore:
    def __init__(
        self,
        backend: Backend,
        keyspace: KeySpace,
        payload_size: int | None = None,
        max_pending_blocks: int = 1024,
        timeout_s: float = 1.0,
        retry_s: float = 5.0,
        url: str = "",
    ) -> None:
        self.backend = backend
        self.keyspace = keyspace
        self.payload_size = payload_size  # a stored block's payload bytes; others are corrupt
        self.max_pending_blocks = max_pending_blocks
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.url = url
        self.hit_blocks = 0  # blocks found and fetched for a lookup
        self.miss_blocks = 0  # blocks looked up past the tree's match and not found
        self.read_bytes = 0
        self.written_blocks = 0
        self.written_bytes = 0
        self.dropped_writes = 0  # blocks not written: the queue was full or the store down
        self.errors = 0  # backend failures (each a miss or lost writes)
        self.corrupt_entries = 0
        self.pending_blocks = 0  # blocks queued or being written
        self._writes: deque[tuple[list[bytes], Callable[[], list[bytes]]]] = deque()
        self._cond = threading.Condition()  # guards the write queue; notified on every change
        self._changed = threading.Condition()  # notified when a lookup advances
        self._down_until = 0.0
        self._warned = False
        self._closing = False
        self._reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-read")
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-write", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ writes

    def has_room(self, n: int) -> bool:
        """Whether `n` more blocks fit in the write queue now (and the store is up)."""
        ok = self.pending_blocks + n <= self.max_pending_blocks and not self._down() and not self._closing
        if not ok:
            self.dropped_writes += n
        return ok

    def save(self, keys: list[bytes], payloads: Callable[[], list[bytes]]) -> None:
        """Queues blocks for writing; `payloads()` is called on the writer thread and returns
        their bytes in key order. Call after `has_room`."""
        with self._cond:
            self.pending_blocks += len(keys)
            self._writes.append((keys, payloads))
            self._cond.notify_all()

    def lost(self, n: int, exc: BaseException) -> None:
        """`n` blocks could not be copied for writing: dropped, and counted as a failure."""
        self.dropped_writes += n
        self._failed(exc)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued write is done; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self.pending_blocks == 0, timeout_s)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._writes or self._closing)
                if not self._writes:
                    return
                keys, payloads = self._writes.popleft()
            try:
                if self._down():
                    self.dropped_writes += len(keys)
                else:
                    entries = [encode_entry(k, p) for k, p in zip(keys, payloads(), strict=True)]
                    self.backend.put(list(zip(keys, entries, strict=True)))
                    self.written_blocks += len(keys)
                    self.written_bytes += sum(len(e) for e in entries)
            except Exception as exc:  # the store failed: these writes are lost, nothing else
                self.dropped_writes += len(keys)
                self._failed(exc)
            finally:
                with self._cond:
                    self.pending_blocks -= len(keys)
                    self._cond.notify_all()

    # ------------------------------------------------------------------- reads

    def lookup(self, tokens: list[int]) -> StoreLookup:
        """Starts looking up the full blocks of `tokens` (a prompt without its last token, as the
        cache keys it: salted)."""
        lookup = StoreLookup(list(tokens), time.monotonic() + self.timeout_s)
        if self._down() or len(tokens) < self.keyspace.block_size:
            self._resolve(lookup, StoredRun(0))
        else:
            self._reader.submit(self._exists, lookup)
        return lookup

    def poll(self, lookup: StoreLookup, start_block: int, wait_s: float = 0.0) -> StoredRun | None:
        """At admission, with the tree matching `start_block` whole blocks: the run of stored
        blocks that continues the match (fetched, perhaps empty), or None while the request must
        wait for the store. Waits at most `wait_s` in all, for the existence check and the fetch
        (each usually takes well under a millisecond on a local disk; the request then goes
        this step)."""
        end = time.monotonic() + wait_s
        with self._changed:
            while not lookup.done:
                if not lookup.busy:  # which blocks exist is known: fetch what continues the match
                    keys = self._begin_fetch(lookup, start_block)
                    if keys:
                        self._reader.submit(self._fetch, lookup, start_block, keys)
                    continue
                if lookup.fetch_from is None:  # the existence check chains the fetch from here
                    lookup.want_from = start_block
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            if lookup.done:
                return lookup.run
        if time.monotonic() <= lookup.deadline:  # due by then (the engine's pace is not the store's)
            return None
        self._slow()
        return self._resolve(lookup, StoredRun(start_block))

    def _begin_fetch(self, lookup: StoreLookup, start_block: int) -> list[bytes]:
        """Under `_changed`: the keys of the present run from `start_block` on, marked as being
        fetched; none (and the lookup resolved, empty) when there is no such run."""
        present = lookup.present[start_block:]
        n = next((i for i, p in enumerate(present) if not p), len(present))
        self.miss_blocks += len(present) - n
        if n == 0:
            self._resolve(lookup, StoredRun(start_block))
            return []
        lookup.busy, lookup.fetch_from = True, start_block
        lookup.deadline = time.monotonic() + self.timeout_s
        return lookup.keys[start_block : start_block + n]

    def wait(self, timeout_s: float) -> None:
        """Returns when a lookup advances, or after `timeout_s`."""
        with self._changed:
            self._changed.wait(timeout_s)

    def _exists(self, lookup: StoreLookup) -> None:
        try:
            keys = self.keyspace.block_keys(lookup.tokens, len(lookup.tokens))
            present = self.backend.exists(keys)
        except Exception as exc:
            self._failed(exc)
            self._resolve(lookup, StoredRun(0))
            return
        with self._changed:
            lookup.keys, lookup.present = keys, present
            start = lookup.want_from
            fetch = self._begin_fetch(lookup, start) if start is not None and not lookup.done else []
            if start is None:
                lookup.busy = False
            self._changed.notify_all()
        if fetch:
            self._fetch(lookup, start, fetch)

    def _fetch(self, lookup: StoreLookup, first: int, keys: list[bytes]) -> None:
        blocks = []
        try:
            for key, entry in zip(keys, self.backend.get(keys), strict=True):
                if entry is None:
                    break
                self.read_bytes += len(entry)
                try:
                    blocks.append(StoredBlock(decode_entry(key, entry, self.payload_size)))
                except CorruptEntry as exc:
                    self.corrupt_entries += 1
                    log.warning("kv store %s: entry %s is damaged (%s): recomputed", self.url, key.hex(), exc)
                    break
        except Exception as exc:
            self._failed(exc)
        self.hit_blocks += len(blocks)
        self.miss_blocks += len(keys) - len(blocks)
        self._resolve(lookup, StoredRun(first, blocks))

    def _resolve(self, lookup: StoreLookup, run: StoredRun) -> StoredRun:
        with self._changed:
            if not lookup.done:
                lookup.run, lookup.done, lookup.busy = run, True, False
            self._changed.notify_all()
        return lookup.run

    # --------------------------------------------------------------- failures

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + self.retry_s
        if not self._warned:
            self._warned = True
            log.warning(
                "kv store %s failed (%s: %s): a miss, and skipped for %.0f s after each failure "
                "(logged once)",
                self.url,
                type(exc).__name__,
                exc,
                self.retry_s,
            )

    def _slow(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kv store %s took over %.1f s: a miss (logged once)", self.url, self.timeout_s)

    # ------------------------------------------------------------------ the rest

    def metrics(self) -> dict[str, int]:
        return {
            "kv_store_hit_blocks": self.hit_blocks,
            "kv_store_miss_blocks": self.miss_blocks,
            "kv_store_read_bytes": self.read_bytes,
            "kv_store_written_blocks": self.written_blocks,
            "kv_store_written_bytes": self.written_bytes,
            "kv_store_dropped_writes": self.dropped_writes,
            "kv_store_write_queue_blocks": self.pending_blocks,
            "kv_store_errors": self.errors,
            "kv_store_corrupt_entries": self.corrupt_entries,
        }

    def close(self, timeout_s: float = 60.0) -> None:
        """Writes what is queued (for at most `timeout_s`), then stops the threads. Idempotent."""
        if self._closing:
            return
        if not self.flush(timeout_s):
            log.warning("kv store %s: %d blocks still unwritten at close", self.url, self.pending_blocks)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._writer.join(timeout_s)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
