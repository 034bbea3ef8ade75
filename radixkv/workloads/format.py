"""Workload files: the chat sessions `radixkv replay` sends, one JSON object a line.

A line is one session:

    {"session": "s0", "arrival": 0.0, "system": "You are ...",
     "turns": [{"user": "Hello", "max_tokens": 32, "think": 0.5}, {"user": "More", "max_tokens": 16}]}

`system_ids` / `user_ids` (token ids) may stand instead of `system` / `user`; a session is all text
or all ids, and `system` is optional. The session starts `arrival` seconds into the replay (default
0). Its first turn is sent `think` seconds after the arrival, every later turn `think` seconds
(default 0) after the previous reply ends. A turn's prompt is the whole conversation so far: the
system part, each earlier user message and the reply the engine itself generated for it, then the
new user message -- through the chat template for text, plain concatenation for ids. Every reply
runs exactly `max_tokens` tokens (EOS ignored), so id prompts have known lengths.

An optional first line `{"format": "radixkv-workload", "version": 1, ...}` carries metadata
(generator, parameters, seed, vocabulary range, the command that made the file).

The reader checks everything before returning anything: one malformed line fails the whole file
with a `WorkloadError` naming the file and line, so a replay never stops halfway through.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "radixkv-workload"
VERSION = 1

_SESSION_KEYS = ("session", "arrival", "system", "system_ids", "turns")
_TURN_KEYS = ("user", "user_ids", "max_tokens", "think")


class WorkloadError(ValueError):
    """A workload file or session the reader rejects; the message says where and what to fix."""


@dataclass(slots=True)
class Turn:
    """One user message and the reply asked for it.

    `user` is text (sent through the chat template) or a list of token ids (appended as is).
    """

    user: str | list[int]
    max_tokens: int
    think: float = 0.0


@dataclass(slots=True)
class Session:
    """One chat session: its turns are sent one after another, each after the previous reply."""

    name: str
    turns: list[Turn]
    arrival: float = 0.0
    system: str | list[int] | None = None

    @property
    def uses_ids(self) -> bool:
        return isinstance(self.turns[0].user, list)

    def prompt_lengths(self) -> list[int]:
        """Each turn's prompt length in tokens: system, earlier users and replies, this user.

        Only id sessions have lengths without a tokenizer; a text session raises `ValueError`.
        """
        if not self.uses_ids:
            raise ValueError(f"session {self.name!r} is text: its prompt lengths need a tokenizer")
        lengths = []
        total = len(self.system or [])
        for turn in self.turns:
            total += len(turn.user)
            lengths.append(total)
            total += turn.max_tokens
        return lengths


@dataclass(slots=True)
class Workload:
    """A read workload file: its sessions in file order and its metadata (without format and version)."""

    sessions: list[Session]
    meta: dict[str, Any] = field(default_factory=dict)


def read_workload(path: str | Path) -> Workload:
    """Reads and validates a workload file; any malformed line raises `WorkloadError` naming file:line."""
    path = Path(path)
    sessions: list[Session] = []
    meta: dict[str, Any] | None = None
    first_line: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = _loads(line)
                if isinstance(obj, dict) and "format" in obj:
                    if sessions or meta is not None:
                        raise ValueError("the metadata line must be the first line")
                    meta = _parse_meta(obj)
                else:
                    session = session_from_json(obj)
                    earlier = first_line.setdefault(session.name, lineno)
                    if earlier != lineno:
                        raise ValueError(f"session {session.name!r} is already on line {earlier}")
                    sessions.append(session)
            except ValueError as e:
                raise WorkloadError(f"{path}:{lineno}: {e}") from None
    if not sessions:
        raise WorkloadError(f"{path}: no sessions")
    return Workload(sessions, meta or {})


def write_workload(path: str | Path, sessions: list[Session], meta: dict[str, Any]) -> None:
    """Writes the metadata line, then one line per session.

    Every session goes through the reader's checks first, so nothing is written that
    `read_workload` would reject; the file appears whole or not at all (written aside, then renamed).
    """
    path = Path(path)
    if "format" in meta or "version" in meta:
        raise ValueError("meta must not set 'format' or 'version': the writer sets them")
    if not sessions:
        raise WorkloadError(f"{path}: no sessions to write")
    lines = [_dumps({"format": FORMAT, "version": VERSION, **meta})]
    seen: set[str] = set()
    for index, session in enumerate(sessions):
        obj = session_to_json(session)
        try:
            session_from_json(obj)
            if session.name in seen:
                raise ValueError(f"session {session.name!r} appears twice")
        except ValueError as e:
            raise WorkloadError(f"{path}: sessions[{index}]: {e}") from None
        seen.add(session.name)
        lines.append(_dumps(obj))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def session_to_json(session: Session) -> dict[str, Any]:
    """The file form of a session: `*_ids` keys for id lists, `think` left out when 0."""
    obj: dict[str, Any] = {"session": session.name, "arrival": session.arrival}
    if session.system is not None:
        obj["system_ids" if isinstance(session.system, list) else "system"] = session.system
    turns = []
    for turn in session.turns:
        t: dict[str, Any] = {"user_ids" if isinstance(turn.user, list) else "user": turn.user}
        t["max_tokens"] = turn.max_tokens
        if turn.think:
            t["think"] = turn.think
        turns.append(t)
    obj["turns"] = turns
    return obj


def session_from_json(obj: Any) -> Session:
    """Validates one session object; raises `ValueError` saying which field is wrong and why."""
    if not isinstance(obj, dict):
        raise ValueError(f"a session must be a JSON object, got {type(obj).__name__}")
    _check_keys(obj, _SESSION_KEYS, "")
    name = obj.get("session")
    if not isinstance(name, str) or not name:
        raise ValueError("session must be a non-empty string (the session's name)")
    arrival = _seconds(obj, "arrival", "")
    if "system" in obj and "system_ids" in obj:
        raise ValueError("give system or system_ids, not both")
    system: str | list[int] | None = None
    if "system" in obj:
        system = _text(obj["system"], "system")
    elif "system_ids" in obj:
        system = _ids(obj["system_ids"], "system_ids")
    raw_turns = obj.get("turns")
    if not isinstance(raw_turns, list) or not raw_turns:
        raise ValueError("turns must be a non-empty list")
    turns = [_turn(raw, f"turns[{k}]") for k, raw in enumerate(raw_turns)]
    kinds = {isinstance(t.user, list) for t in turns}
    if system is not None:
        kinds.add(isinstance(system, list))
    if len(kinds) > 1:
        raise ValueError("mixes text (system/user) and token ids (system_ids/user_ids): use one kind")
    return Session(name=name, turns=turns, arrival=arrival, system=system)


def _turn(obj: Any, where: str) -> Turn:
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(obj).__name__}")
    _check_keys(obj, _TURN_KEYS, where + ".")
    if ("user" in obj) == ("user_ids" in obj):
        raise ValueError(f"{where} needs exactly one of user (text) and user_ids (token ids)")
    if "user" in obj:
        user: str | list[int] = _text(obj["user"], f"{where}.user")
    else:
        user = _ids(obj["user_ids"], f"{where}.user_ids")
    max_tokens = obj.get("max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"{where}.max_tokens must be an integer >= 1, got {max_tokens!r}")
    return Turn(user=user, max_tokens=max_tokens, think=_seconds(obj, "think", where + "."))


def _parse_meta(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["format"] != FORMAT:
        raise ValueError(f"format must be {FORMAT!r}, got {obj['format']!r}")
    if obj.get("version") != VERSION:
        raise ValueError(f"version {obj.get('version')!r} is not supported (this reader reads {VERSION})")
    return {k: v for k, v in obj.items() if k not in ("format", "version")}


def _check_keys(obj: dict[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
    for key in obj:
        if key not in allowed:
            raise ValueError(f"{prefix}{key} is not a known key (known: {', '.join(allowed)})")


def _seconds(obj: dict[str, Any], key: str, prefix: str) -> float:
    value = obj.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{prefix}{key} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__}")
    return value


def _ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of token ids")
    for k, token in enumerate(value):
        if not _is_int(token) or token < 0:
            raise ValueError(f"{where}[{k}] must be a token id (an integer >= 0), got {token!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _loads(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
