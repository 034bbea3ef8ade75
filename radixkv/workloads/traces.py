"""Hash-id request traces (Mooncake style) and the token runs that stand for their blocks.

A Mooncake-style line is `{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`. An id names the whole prefix up to and including its block, so two requests
share exactly the leading blocks whose ids they share. Turning each id into its own run of
`hash_block` tokens keeps that sharing exact at any scale: 16 tokens per id instead of 512
scales a trace down 32 times without changing which prefixes are shared.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import xxhash

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a hash-id trace. `arrival_s` is in seconds from the trace's start;
    `session` is the trace's `session_id` where it has one (agent traces)."""

    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None


class TraceFormatError(ValueError):
    """A trace line that cannot be read; the message names the file and line."""


def read_hash_trace(path: str | Path) -> list[TraceRequest]:
    """Reads a Mooncake-style JSONL trace; a malformed line fails the whole file up front."""
    return read_trace_rows(
        path,
        "hash-id trace",
        lambda row: TraceRequest(
            arrival_s=float(row.get("timestamp", 0)) / 1000.0,
            input_length=int(row.get("input_length", 0)),
            output_length=int(row.get("output_length", 0)),
            hash_ids=tuple(row["hash_ids"]),
            session=str(row["session_id"]) if "session_id" in row else None,
        ),
    )


def read_trace_rows(path: str | Path, kind: str, parse: Callable[[dict[str, Any]], T]) -> list[T]:
    """Every non-empty line of a JSONL trace with `hash_ids`, turned into a record by `parse`. A
    line that is not JSON, lacks a field or has bad ids fails the whole file, naming file and line."""
    path = Path(path)
    rows = []
    for lineno, line in enumerate(iter_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids = row["hash_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError("hash_ids must be a list of integers")
            rows.append(parse(row))
        except KeyError as e:
            raise TraceFormatError(f"{path}:{lineno}: not a {kind} line: missing {e}") from None
        except (ValueError, TypeError) as e:
            raise TraceFormatError(f"{path}:{lineno}: not a {kind} line: {e}") from None
    return rows


def iter_lines(path: Path) -> Iterator[str]:
    """The lines of a text file, gzip-compressed when its name ends in `.gz`."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            yield from f
    else:
        with path.open(encoding="utf-8") as f:
            yield from f


class HashIdTokens:
    """Maps each hash id to a deterministic run of `hash_block` token ids.

    With `vocab_size=None` the runs are disjoint integer ranges, so no two ids ever share a
    token and a cache sees exactly the trace's block-level sharing. With a vocabulary (to feed a
    real model) each run is drawn from `[low, vocab_size)` by a generator seeded with the id.
    """

    def __init__(self, hash_block: int, vocab_size: int | None = None, low: int = 0) -> None:
        if hash_block < 1:
            raise ValueError(f"hash_block must be >= 1, got {hash_block}")
        if vocab_size is not None and not 0 <= low < vocab_size:
            raise ValueError(f"need 0 <= low < vocab_size, got low={low}, vocab_size={vocab_size}")
        self.hash_block = hash_block
        self.vocab_size = vocab_size
        self.low = low
        self._memo: dict[int, list[int]] = {}

    def run(self, hash_id: int) -> list[int]:
        cached = self._memo.get(hash_id)
        if cached is None:
            if self.vocab_size is None:
                start = hash_id * self.hash_block
                cached = list(range(start, start + self.hash_block))
            else:
                seed = xxhash.xxh64_intdigest(hash_id.to_bytes(8, "little", signed=True))
                rng = np.random.default_rng(seed)
                cached = rng.integers(self.low, self.vocab_size, self.hash_block).tolist()
            self._memo[hash_id] = cached
        return cached

    def tokens(self, hash_ids: tuple[int, ...] | list[int]) -> list[int]:
        """The ids' runs end to end; a request of a long trace has thousands of ids, most seen before."""
        memo, out = self._memo, []
        for hash_id in hash_ids:
            run = memo.get(hash_id)
            out.extend(self.run(hash_id) if run is None else run)
        return out
