"""How the server answers the dashboard's polls without asking the engine for each one.

Every open page polls a few times a second; the engine is asked at most once per `max_age_s` per
scope (the whole cache, or one key's namespaces), however many pages poll: a poll within
`max_age_s` of the last answer gets that answer, and polls that arrive while an answer is being
built wait for it instead of asking again. However many scopes are watched, the engine calls are
`min_gap_s` apart at least (so at most 8 a second by default: with many keys' pages open, each
key's answer gets older instead of the step loop waiting more). The engine call runs in a worker
thread, so the event loop keeps streaming meanwhile; in the engine it runs between two steps
(`cache_view`). An answer nobody asked for in `STALE_S` is dropped.

The history (`History`) takes one sample per answer built, at most one per `max_age_s`: it starts
when the first page opens and costs nothing while none is open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from radixkv.dashboard.history import History

MAX_AGE_S = 0.25
MIN_GAP_S = 0.125
STALE_S = 60.0
Scope = tuple[int, ...] | None
"""The namespaces (`salt_offset`s) a view shows; None for the whole cache."""


class SnapshotCache:
    def __init__(
        self,
        fetch: Callable[[list[int] | None], dict[str, Any]],
        max_age_s: float = MAX_AGE_S,
        history: History | None = None,
        min_gap_s: float = MIN_GAP_S,
    ) -> None:
        """`fetch(namespaces)` is the engine's `dashboard`: blocking, so run in a thread."""
        self.fetch = fetch
        self.max_age_s = max_age_s
        self.min_gap_s = min_gap_s
        self.history = history if history is not None else History()
        self.fetches = 0  # engine calls made, for tests and the bench
        self._answers: dict[Scope, tuple[float, dict[str, Any]]] = {}
        self._pending: dict[Scope, asyncio.Future] = {}
        self._sampled_at = float("-inf")
        self._called_at = float("-inf")
        self._gate = asyncio.Lock()  # spaces the engine calls of every scope

    async def get(self, scope: Scope) -> dict[str, Any]:
        """The view of `scope`, at most `max_age_s` old."""
        answer = self._answers.get(scope)
        if answer is not None and time.monotonic() - answer[0] < self.max_age_s:
            return answer[1]
        pending = self._pending.get(scope)
        if pending is None:
            pending = self._pending[scope] = asyncio.ensure_future(self._refresh(scope))
        return await asyncio.shield(pending)  # one caller going away never cancels the others'

    async def _refresh(self, scope: Scope) -> dict[str, Any]:
        try:
            async with self._gate:
                wait = self._called_at + self.min_gap_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._called_at = time.monotonic()
            self.fetches += 1
            view = await asyncio.to_thread(self.fetch, None if scope is None else list(scope))
            now = time.monotonic()
            if now - self._sampled_at >= self.max_age_s:
                self.history.add(view)
                self._sampled_at = now
            self._answers = {s: a for s, a in self._answers.items() if now - a[0] < STALE_S}
            self._answers[scope] = (now, view)
            return view
        finally:
            del self._pending[scope]
