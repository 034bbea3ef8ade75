"""The dashboard's history: a ring of samples taken from views the engine already reports.

Each sample is a few numbers, no content: when, the hit rate since the sample before (prompt
tokens found / looked up over that interval) and overall, tokens saved so far, device blocks by
state, and the adaptive policy's window share. The ring keeps the last `size` samples (at the
default 4 a second, about five minutes), so its memory is fixed however long the server runs.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

HISTORY_SIZE = 1200


class History:
    def __init__(self, size: int = HISTORY_SIZE) -> None:
        self.samples: deque[dict[str, Any]] = deque(maxlen=size)
        self._last: tuple[int, int] | None = None
        self._start = time.monotonic()

    def add(self, view: dict[str, Any]) -> None:
        """Appends the sample of `view` (`cache_view`'s dict)."""
        m = view["metrics"]
        queries, hits = m["prefix_cache_queries"], m["prefix_cache_hits"]
        last_q, last_h = self._last or (0, 0)
        asked = queries - last_q
        self._last = (queries, hits)
        policy = view.get("policy") or {}
        self.samples.append(
            {
                "t": round(time.monotonic() - self._start, 3),
                "hit_rate": (hits - last_h) / asked if asked > 0 else None,
                "hit_rate_total": hits / queries if queries else 0.0,
                "tokens_saved": hits,
                "device": view["blocks"]["device"],
                "window_share": policy.get("window_share"),
            }
        )

    def as_list(self) -> list[dict[str, Any]]:
        return list(self.samples)
