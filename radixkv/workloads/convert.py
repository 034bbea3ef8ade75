"""Converters from request traces to workload sessions.

- `mooncake`: a Mooncake-style hash-id trace; every request becomes a one-turn session.
- `claude-code`: coding-agent sessions with hash ids; a session's requests become its turns.
- `sharegpt`: ShareGPT-style text conversations; a session per conversation.

Hash ids become tokens only through `HashIdTokens` over the chosen vocabulary range, `hash_block`
tokens per id, so two requests that share their first k ids share exactly their first
k x hash_block tokens (a smaller block scales the trace down, keeping its sharing). A request's
last, partly filled block is not in its ids and so is not replayed. Replies get
`max(1, min(output_length, --max-tokens-cap))` tokens: a trace's zero-length outputs still need
one token to end.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np

from radixkv.workloads.format import Session, Turn
from radixkv.workloads.generate import Flag, check_params, poisson_arrivals, vocab_of
from radixkv.workloads.traces import (
    HashIdTokens,
    TraceFormatError,
    iter_lines,
    read_hash_trace,
    read_trace_rows,
)

_USER_ROLES = ("human", "user")
_REPLY_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing")


def _max_tokens(output_length: int, cap: int | None) -> int:
    return max(1, output_length if cap is None else min(output_length, cap))


@dataclass(slots=True)
class MooncakeParams:
    """Mooncake trace: request i becomes session `r<i>`, arriving at its timestamp (first at 0)."""

    hash_block: Annotated[int, Flag("tokens per hash id (< 512 scales the trace down)", minimum=1)] = 512
    max_tokens_cap: Annotated[int | None, Flag("cap on a reply's max_tokens", minimum=1)] = None
    max_requests: Annotated[int | None, Flag("convert only the first N requests", minimum=1)] = None
    time_scale: Annotated[float, Flag("multiply arrival times by this (0: all at once)", minimum=0)] = 1.0
    vocab_size: Annotated[int, Flag("token ids are drawn below this")] = 256
    vocab_low: Annotated[int, Flag("token ids are drawn from this up")] = 0

    def __post_init__(self) -> None:
        check_params(self)


def convert_mooncake(path: str | Path, p: MooncakeParams) -> list[Session]:
    """One one-turn id session per request; a request without hash ids has no prompt and is dropped."""
    requests = read_hash_trace(path)[: p.max_requests]
    if not requests:
        raise TraceFormatError(f"{path}: no requests")
    tokens = vocab_of(p).hash_tokens(p.hash_block)
    start = min(r.arrival_s for r in requests)
    return [
        Session(
            f"r{i}",
            [Turn(tokens.tokens(r.hash_ids), _max_tokens(r.output_length, p.max_tokens_cap))],
            round((r.arrival_s - start) * p.time_scale, 6),
        )
        for i, r in enumerate(requests)
        if r.hash_ids
    ]


@dataclass(frozen=True, slots=True)
class _AgentRequest:
    session: str
    agent: str
    t_s: float
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True)
class ClaudeCodeParams:
    """Coding-agent trace (`session_id`, `agent`, `t_session_s`, `output_length`, `hash_ids`)."""

    hash_block: Annotated[int, Flag("tokens per hash id (< 64 scales the trace down)", minimum=1)] = 64
    common_prefix_tokens: Annotated[int, Flag("system tokens common to all sessions", minimum=0)] = 0
    rate: Annotated[float, Flag("trace-session arrivals per second (Poisson; inf: all at 0)")] = 0.1
    time_scale: Annotated[float, Flag("multiply think times and split offsets by this", minimum=0)] = 1.0
    max_think: Annotated[float | None, Flag("cap on a think time, seconds", minimum=0)] = None
    max_tokens_cap: Annotated[int | None, Flag("cap on a reply's max_tokens", minimum=1)] = None
    max_sessions: Annotated[int | None, Flag("convert only the first N trace sessions", minimum=1)] = None
    seed: Annotated[int, Flag("random seed (session arrivals)")] = 0
    vocab_size: Annotated[int, Flag("token ids are drawn below this")] = 256
    vocab_low: Annotated[int, Flag("token ids are drawn from this up")] = 0

    def __post_init__(self) -> None:
        check_params(self)


def convert_claude_code(path: str | Path, p: ClaudeCodeParams) -> list[Session]:
    """Trace sessions become workload sessions; a request that does not extend the last one splits.

    A trace session's requests are taken in file order, each agent on its own. A request continues
    the agent's current session when its ids start with all of the previous request's ids and add
    at least one: the new turn's `user_ids` are the tokens of the added ids, its `think` the scaled
    `t_session_s` gap (it includes the original reply's time). Otherwise -- a context reset or
    compaction, a rewritten last block, a subagent's first request -- it starts a new session
    `<session_id>#<n>` whose first turn is the whole prompt, arriving at the trace session's arrival
    plus the scaled `t_session_s`. So within every converted session, `system_ids` (the common
    prefix) then the user ids of turns 1..k are exactly the tokens of request k's ids.

    A replay puts the engine's own replies between the turns while the trace's ids already hold
    the original replies, so a replayed prompt is longer than the traced one by the earlier turns'
    `max_tokens`, yet extends the previous prompt just as in the trace. A split session shares with
    its parent only what its first turn shares with the parent's first turn. A `hash_block` below
    the trace's 64 shrinks prompts, not replies: pair it with `--max-tokens-cap`. Trace sessions
    have no start times: they arrive by a seeded Poisson process, in file order. A request without
    hash ids has no prompt and is dropped.
    """
    by_session: dict[str, list[_AgentRequest]] = {}
    for request in _read_agent_trace(Path(path)):
        by_session.setdefault(request.session, []).append(request)
    names = list(by_session)[: p.max_sessions]
    if not names:
        raise TraceFormatError(f"{path}: no requests")
    tokens = vocab_of(p).hash_tokens(p.hash_block)
    common = _common_prefix(tokens, p)
    sessions = []
    arrivals = poisson_arrivals(np.random.default_rng(p.seed), len(names), p.rate)
    for name, arrival in zip(names, arrivals, strict=True):
        sessions += _split_session(name, arrival, by_session[name], tokens, common, p)
    sessions.sort(key=lambda s: s.arrival)
    return sessions


def _common_prefix(tokens: HashIdTokens, p: ClaudeCodeParams) -> list[int] | None:
    """The runs of ids -1, -2, ... (ids no trace uses), cut to `common_prefix_tokens`."""
    n = p.common_prefix_tokens
    return tokens.tokens(list(range(-1, -1 - math.ceil(n / p.hash_block), -1)))[:n] or None


def _split_session(
    name: str,
    arrival: float,
    requests: list[_AgentRequest],
    tokens: HashIdTokens,
    common: list[int] | None,
    p: ClaudeCodeParams,
) -> list[Session]:
    pieces: list[Session] = []
    current: dict[str, tuple[Session, _AgentRequest]] = {}
    for r in requests:
        if not r.hash_ids:
            continue
        max_tokens = _max_tokens(r.output_length, p.max_tokens_cap)
        open_piece = current.get(r.agent)
        if open_piece and _extends(r.hash_ids, open_piece[1].hash_ids):
            session, last = open_piece
            think = max(0.0, r.t_s - last.t_s) * p.time_scale
            if p.max_think is not None:
                think = min(think, p.max_think)
            added = tokens.tokens(r.hash_ids[len(last.hash_ids) :])
            session.turns.append(Turn(added, max_tokens, round(think, 6)))
        else:
            session = Session(
                f"{name}#{len(pieces)}" if pieces else name,
                [Turn(tokens.tokens(r.hash_ids), max_tokens)],
                round(arrival + r.t_s * p.time_scale, 6),
                common,
            )
            pieces.append(session)
        current[r.agent] = (session, r)
    return pieces


def _extends(ids: tuple[int, ...], previous: tuple[int, ...]) -> bool:
    return len(ids) > len(previous) and ids[: len(previous)] == previous


def _read_agent_trace(path: Path) -> list[_AgentRequest]:
    return read_trace_rows(path, "coding-agent trace", _agent_request)


def _agent_request(row: dict[str, Any]) -> _AgentRequest:
    t_s = float(row["t_session_s"])
    if not t_s >= 0:
        raise ValueError(f"t_session_s must be >= 0, got {t_s}")
    return _AgentRequest(
        str(row["session_id"]),
        str(row.get("agent", "main")),
        t_s,
        int(row.get("output_length", 0)),
        tuple(row["hash_ids"]),
    )


@dataclass(slots=True)
class ShareGPTParams:
    """ShareGPT conversations (`{"conversations": [{"from": "human"|"gpt", "value": ...}]}`)."""

    system: Annotated[str | None, Flag("system prompt text shared by all sessions")] = None
    max_tokens_cap: Annotated[int, Flag("cap on a reply's max_tokens", minimum=1)] = 512
    tokenizer: Annotated[
        str | None, Flag("Hugging Face tokenizer (name or path) counting reply tokens instead of UTF-8 bytes")
    ] = None
    max_sessions: Annotated[int | None, Flag("convert only the first N conversations", minimum=1)] = None
    max_turns: Annotated[int | None, Flag("keep a conversation's first N turns", minimum=1)] = None
    rate: Annotated[float, Flag("session arrivals per second (Poisson; inf: all at 0)")] = 1.0
    think: Annotated[float, Flag("seconds between a reply's end and the next user turn", minimum=0)] = 0.0
    seed: Annotated[int, Flag("random seed (session arrivals)")] = 0

    def __post_init__(self) -> None:
        check_params(self)


def convert_sharegpt(path: str | Path, p: ShareGPTParams) -> list[Session]:
    """A text session `c<k>` per conversation k (0-based, in file order) that has a user turn with a reply.

    A turn is a user message and the reply after it; its `max_tokens` is the reply's length. Roles
    human/user are the user's, gpt/assistant/chatgpt/bard/bing replies; any other role fails the
    file. Consecutive user messages are joined by a blank line, a reply with no user message before
    it is dropped, and so is a last user message without a reply (no length to ask for).
    Reads JSON lines (optionally .gz) or one JSON array of conversations.
    """
    count = _token_counter(p.tokenizer)
    sessions = []
    for k, (where, obj) in enumerate(_conversations(Path(path))):
        if p.max_sessions is not None and len(sessions) == p.max_sessions:
            break
        try:
            turns = _chat_turns(obj, count, p)
        except KeyError as e:
            raise TraceFormatError(f"{where}: not a ShareGPT conversation: missing {e}") from None
        except (ValueError, TypeError) as e:
            raise TraceFormatError(f"{where}: not a ShareGPT conversation: {e}") from None
        if turns:
            sessions.append(Session(f"c{k}", turns[: p.max_turns], 0.0, p.system))
    if not sessions:
        raise TraceFormatError(f"{path}: no conversation with a user turn and a reply")
    arrivals = poisson_arrivals(np.random.default_rng(p.seed), len(sessions), p.rate)
    for session, arrival in zip(sessions, arrivals, strict=True):
        session.arrival = arrival
    return sessions


def _chat_turns(obj: Any, count: Callable[[str], int], p: ShareGPTParams) -> list[Turn]:
    turns: list[Turn] = []
    pending: list[str] = []
    for message in obj["conversations"]:
        role, text = message["from"], message["value"]
        if not isinstance(text, str):
            raise ValueError(f"value must be a string, got {type(text).__name__}")
        if role in _USER_ROLES:
            pending.append(text)
        elif role not in _REPLY_ROLES:
            raise ValueError(f"unknown role {role!r} (user: {_USER_ROLES}, reply: {_REPLY_ROLES})")
        elif pending:
            think = p.think if turns else 0.0
            turns.append(Turn("\n\n".join(pending), _max_tokens(count(text), p.max_tokens_cap), think))
            pending = []
    return turns


def _conversations(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, conversation) pairs: `file:line` for JSON lines, `file: item k` for a JSON array."""
    lines = iter_lines(path)
    first = True
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            if first and line.lstrip().startswith("["):
                items = json.loads(line + "".join(lines))
                yield from ((f"{path}: item {k}", item) for k, item in enumerate(items))
                return
            obj = json.loads(line)
        except ValueError as e:
            raise TraceFormatError(f"{path}:{lineno}: invalid JSON: {e}") from None
        first = False
        yield f"{path}:{lineno}", obj


def _token_counter(tokenizer: str | None) -> Callable[[str], int]:
    if tokenizer is None:
        return lambda text: len(text.encode("utf-8"))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda text: len(tok.encode(text, add_special_tokens=False))
