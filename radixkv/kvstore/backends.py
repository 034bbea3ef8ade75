"""Where stored blocks live, behind one small batched interface: `exists`, `get`, `put`.

- `file://DIR[?max_bytes=N]`: one file per block under DIR (`ab/cdef....kv`, by the key's hex).
  A write goes to a temporary file in the same folder and is renamed over the name, so a reader
  (in this process or another on the machine) sees a whole entry or none, and a crash leaves at
  most a stray temporary file. A read refreshes the file's mtime; past `max_bytes` (default
  unlimited) the least recently used files are deleted, oldest mtime first, down to 90% of it.
  Several processes may share a folder: every step is a rename, a read or an unlink that
  tolerates the file being gone.
- `redis://host:port/db` (Valkey too): one string per block under `rkv:` + key. A size cap is the
  server's (`maxmemory` with `maxmemory-policy allkeys-lru`). The client times out after
  `timeout_s`.
- `MemoryBackend(capacity)`: an in-process LRU of `capacity` entries, for tests and `simulate`.

Backends raise on failure (a missing folder, a refused connection); `KVStore` turns that into a
miss. They never check entries: `KVStore` does (`radixkv.kvstore.entry`).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qs, urlparse


class Backend(Protocol):
    def exists(self, keys: list[bytes]) -> list[bool]: ...

    def get(self, keys: list[bytes]) -> list[bytes | None]: ...

    def put(self, items: list[tuple[bytes, bytes]]) -> None: ...

    def close(self) -> None: ...


class FileBackend:
    SUFFIX = ".kv"

    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._written_since_trim = 0
        self._lock = threading.Lock()

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name[2:] + self.SUFFIX)

    def exists(self, keys: list[bytes]) -> list[bool]:
        return [self.path(k).is_file() for k in keys]

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self.path(key)
            try:
                data = path.read_bytes()
                os.utime(path)  # recently used: last to go under the size cap
            except FileNotFoundError:
                data = None
            out.append(data)
        return out

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        for key, entry in items:
            path = self.path(key)
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(entry)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        if self.max_bytes is not None:
            with self._lock:
                self._written_since_trim += sum(len(e) for _, e in items)
                if self._written_since_trim >= self.max_bytes // 10:
                    self._written_since_trim = 0
                    self.trim()

    def trim(self) -> int:
        """Deletes the least recently used entries while the folder holds more than `max_bytes`,
        down to 90% of it; returns the bytes freed."""
        files = []
        total = 0
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for f in os.scandir(sub.path):
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                if f.name.endswith(self.SUFFIX):
                    files.append((st.st_mtime_ns, st.st_size, f.path))
                    total += st.st_size
        if self.max_bytes is None or total <= self.max_bytes:
            return 0
        freed = 0
        target = total - int(self.max_bytes * 0.9)
        for _, size, path in sorted(files):
            if freed >= target:
                break
            try:
                os.unlink(path)
                freed += size
            except FileNotFoundError:
                pass
        return freed

    def close(self) -> None:
        pass


class RedisBackend:
    PREFIX = b"rkv:"

    def __init__(self, url: str, timeout_s: float = 1.0) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def exists(self, keys: list[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.PREFIX + key)
        return [bool(n) for n in pipe.execute()]

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        return self.client.mget([self.PREFIX + k for k in keys]) if keys else []

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, entry in items:
            pipe.set(self.PREFIX + key, entry)
        pipe.execute()

    def close(self) -> None:
        self.client.close()


class MemoryBackend:
    """An LRU of `capacity` entries in this process (None: unbounded)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def exists(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [k in self.entries for k in keys]

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        with self._lock:
            out = []
            for key in keys:
                entry = self.entries.get(key)
                if entry is not None:
                    self.entries.move_to_end(key)
                out.append(entry)
            return out

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        with self._lock:
            for key, entry in items:
                self.entries[key] = entry
                self.entries.move_to_end(key)
            while self.capacity is not None and len(self.entries) > self.capacity:
                self.entries.popitem(last=False)

    def close(self) -> None:
        pass


def open_backend(url: str, timeout_s: float = 1.0) -> Backend:
    """The backend a store URL names. Raises ValueError naming `kv_store` for a bad URL."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if not parsed.path:
            raise ValueError(f"kv_store {url!r} names no folder (file:///absolute/path)")
        query = parse_qs(parsed.query)
        max_bytes = None
        if "max_bytes" in query:
            from radixkv.cache.block_pool import parse_bytes

            max_bytes = parse_bytes(query["max_bytes"][0], "kv_store max_bytes")
        return FileBackend(parsed.netloc + parsed.path if parsed.netloc else parsed.path, max_bytes)
    if parsed.scheme in ("redis", "rediss", "valkey"):
        return RedisBackend(url.replace("valkey://", "redis://", 1), timeout_s)
    raise ValueError(f"kv_store must be file://DIR or redis://host:port/db, got {url!r}")
