"""The one conversation driver of `radixkv replay`: sessions, turns, histories and timing, over a
`Transport` that carries each turn to an engine (in process: `radixkv.tools.replay_in_process`;
an HTTP server: `radixkv.tools.replay_http`).

Sessions arrive at their `arrival` times (divided by the speed); each next turn is due its `think`
time after the previous reply ends, and its prompt is the whole conversation so far, the
engine's own replies included (the transport's history: a `Conversation` of token ids, or the
chat messages an HTTP chat client sends). Time to first token runs from when a turn was due, so
time a request waits behind a busy engine counts, as it does for a user. A turn that fails ends
its session there (the next prompt would need its reply); the driver goes on with the others.

The driver is single-threaded: it submits each turn when due and asks the transport for the
turns that ended, waiting at most until the next one is due. How a transport makes progress
meanwhile (stepping an engine, or threads that wait on HTTP replies) is its own business.
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from radixkv.tools.replay_result import RunResult, TurnRecord, progress_bar
from radixkv.workloads.format import Session, Turn, Workload


class History(Protocol):
    """A session's conversation as its transport sends it: `prompt(user)` is the next request's
    prompt (token ids, or chat messages); `add_reply(ids, text)` commits that message and its
    reply. `radixkv.conversation.Conversation` is one."""

    def prompt(self, user: Any) -> Any: ...

    def add_reply(self, token_ids: list[int], text: str = "") -> None: ...


@dataclass(slots=True)
class Reply:
    """One turn's answer; times are `time.perf_counter()` readings."""

    first_token_s: float
    finish_s: float
    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(slots=True)
class Ended:
    """A submitted turn that ended: its `key` from `Transport.submit`, and its reply, or why it
    failed."""

    key: int
    reply: Reply | None
    error: str | None = None


@dataclass(slots=True)
class Meters:
    """What a transport measured over a run besides the turns (see `RunResult`)."""

    metrics: dict[str, Any]
    kv_usage_peak: float = 0.0
    kv_utilization: float = 0.0


class Transport(ABC):
    """Carries turns to one engine. The driver calls `begin` once before its clock starts,
    `history` once per session, `submit` for each due turn, `wait` until every submitted turn
    has ended, `close_session` after a session's last turn, and `end` once. After a failed
    turn the driver sends its session nothing more; closing it there is the transport's call."""

    @abstractmethod
    def begin(self, workload: Workload) -> None:
        """Set-up that must not count in any turn's time (a server probe, counters read before)."""

    @abstractmethod
    def history(self, session: Session) -> History:
        """A new, empty conversation for `session`."""

    @abstractmethod
    def submit(self, key: int, session: Session, turn: Turn, prompt: Any) -> None:
        """Sends one turn; it ends later in `wait`, under `key`."""

    @abstractmethod
    def wait(self, timeout: float | None) -> list[Ended]:
        """The submitted turns that ended since the last call, waiting up to `timeout` seconds
        (None: until one ends) when none has."""

    @abstractmethod
    def close_session(self, name: str) -> None:
        """The session sends no more turns: its blocks may go first."""

    @abstractmethod
    def end(self) -> Meters:
        """The run is over: what the transport measured."""


def drive(
    workload: Workload,
    transport: Transport,
    speed: float = 1.0,
    progress: bool = False,
    histories: list[History] | None = None,
) -> RunResult:
    """Replays every session of `workload` over `transport`. `histories`, one per session, are
    the conversations its turns continue (a restarted replay's second part: their earlier turns
    ran elsewhere); they are grown in place, so the caller reads the replies from them. By
    default each session starts a new one."""
    sessions = workload.sessions
    transport.begin(workload)
    if histories is None:
        histories = [transport.history(s) for s in sessions]
    due = [(s.arrival / speed + s.turns[0].think / speed, i, 0) for i, s in enumerate(sessions)]
    heapq.heapify(due)
    in_flight: dict[int, tuple[int, int, float]] = {}  # key -> session, turn, due time
    records: list[TurnRecord] = []
    failed: list[str] = []
    bar = progress_bar(sum(len(s.turns) for s in sessions), progress)
    start = time.perf_counter()
    next_key = 0
    while due or in_flight:
        now = time.perf_counter() - start
        while due and due[0][0] <= now:
            t, i, k = heapq.heappop(due)
            turn = sessions[i].turns[k]
            transport.submit(next_key, sessions[i], turn, histories[i].prompt(turn.user))
            in_flight[next_key] = (i, k, t)
            next_key += 1
        timeout = max(0.0, due[0][0] - (time.perf_counter() - start)) if due else None
        for ended in transport.wait(timeout):
            i, k, t = in_flight.pop(ended.key)
            session = sessions[i]
            reply = ended.reply
            if reply is None:
                failed.append(f"{session.name} turn {k}: {ended.error}")
                if bar is not None:
                    bar.update(len(session.turns) - k)
                continue
            histories[i].add_reply(reply.token_ids, reply.text)
            done_s = reply.finish_s - start
            records.append(
                TurnRecord(
                    session.name,
                    k,
                    t,
                    reply.first_token_s - start,
                    done_s,
                    reply.prompt_tokens,
                    reply.cached_tokens,
                    reply.output_tokens,
                )
            )
            if k + 1 < len(session.turns):
                heapq.heappush(due, (done_s + session.turns[k + 1].think / speed, i, k + 1))
            else:
                transport.close_session(session.name)
            if bar is not None:
                bar.update(1)
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    meters = transport.end()
    return RunResult(records, wall, meters.metrics, meters.kv_usage_peak, meters.kv_utilization, failed)
