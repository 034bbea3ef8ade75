"""The chat sessions a server has seen, and when each ends.

A request with the `session_id` extra is a turn of that session: the engine tags what it caches
with the id, and under the `session` eviction policy those blocks outrank one-off requests' and
closed sessions' while the session is open. HTTP has no connection that spans a conversation, so
the server decides when a session ends, in two ways:

- idle timeout: a session with no request in flight for `idle_timeout_s` seconds is closed
  (`radixkv serve --session-idle-timeout`, default 300 s; 0 keeps sessions open until closed);
- explicit close: `DELETE /v1/sessions/{session_id}`, for a client that knows the conversation
  is over.

A session with requests in flight is never closed under them: an explicit close takes effect
when its last request ends, and the idle clock starts when it ends. A later request with the
same id opens the session again, as a later turn does in the engine. Closing only lowers the
blocks' rank; nothing is freed, and a closed session's next turn still finds whatever is cached.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_IDLE_TIMEOUT_S = 300.0


@dataclass(slots=True)
class _Open:
    in_flight: int = 0  # HTTP requests of the session now running
    last_active: float = 0.0  # when the last of them began or ended (the clock's time)
    closing: bool = False  # closed explicitly; takes effect when `in_flight` reaches 0


class SessionTracker:
    """Open sessions in order of last activity. `close_session` is the engine's (it must not
    block: `AsyncEngine.close_session` only queues); `clock` is injectable for tests."""

    def __init__(
        self,
        close_session: Callable[[str], None],
        idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_timeout_s is not None and not idle_timeout_s >= 0:
            raise ValueError(f"session idle timeout must be >= 0 seconds, got {idle_timeout_s}")
        self._close_session = close_session
        self.idle_timeout_s = idle_timeout_s or None  # 0: never by time
        self._clock = clock
        self._open: OrderedDict[str, _Open] = OrderedDict()  # least recently active first

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, session_id: str | None) -> None:
        """The server admits a request: the sessions idle past the timeout close (here as well
        as on the server's timer, for an app run without its lifespan: a replica), then the
        request's session, if it has one, begins."""
        self.expire()
        if session_id is not None:
            self.begin(session_id)

    def begin(self, session_id: str) -> None:
        """A request of the session starts: it is open (again), and not closing any more."""
        entry = self._open.pop(session_id, None) or _Open()
        entry.in_flight += 1
        entry.closing = False
        entry.last_active = self._clock()
        self._open[session_id] = entry

    def end(self, session_id: str) -> None:
        """A request of the session ended, however it ended (done, failed, aborted)."""
        entry = self._open.pop(session_id)
        entry.in_flight -= 1
        entry.last_active = self._clock()
        self._open[session_id] = entry
        if entry.in_flight == 0 and entry.closing:
            self._close(session_id)

    def close(self, session_id: str) -> bool:
        """Closes the session now, or when its requests in flight end; False if it is not open."""
        entry = self._open.get(session_id)
        if entry is None:
            return False
        if entry.in_flight:
            entry.closing = True
        else:
            self._close(session_id)
        return True

    def expire(self) -> list[str]:
        """Closes the sessions idle for the timeout or longer; returns their ids."""
        if self.idle_timeout_s is None:
            return []
        cutoff = self._clock() - self.idle_timeout_s
        idle = []
        for session_id, entry in self._open.items():
            if entry.last_active > cutoff:
                break  # the rest were active later
            if entry.in_flight == 0:
                idle.append(session_id)
        for session_id in idle:
            self._close(session_id)
        return idle

    @property
    def check_interval_s(self) -> float | None:
        """How often `expire` should run: a session then ends at most a tenth of its timeout
        late (checked no more than 20 times a second, and at least once a minute)."""
        if self.idle_timeout_s is None:
            return None
        return min(max(self.idle_timeout_s / 10, 0.05), 60.0)

    def _close(self, session_id: str) -> None:
        del self._open[session_id]
        self._close_session(session_id)
