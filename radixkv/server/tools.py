"""Tool calls in the Hermes format of Qwen2.5 and similar chat templates.

The chat template renders `tools` (transformers' `apply_chat_template(tools=...)`) and the model
answers a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
call. `parse` takes a finished reply apart: the text outside the blocks is the content (None when
only whitespace), each block that holds a JSON object with a `name` a call, whose `arguments`
are kept as the exact JSON text the model wrote (so a stream's fragments add up to it). A block
that does not parse stays in the content, as the model wrote it.

`tool_choice` `required` and a named function do not trust the model: the reply is constrained
by a grammar (`engine_inputs.forced_grammar`: the block around a JSON object whose name is the
tool's and whose arguments follow its `parameters` schema; with `required`, any one tool's), so
it always parses. `auto` parses whatever the model wrote. `ToolStream` does the same on a
stream: content as it comes (a possible `<tool_call>` start held back), then per call a first
delta with its index, id and name and then its argument text in fragments, as OpenAI streams
them. (A stream cannot take back what it sent: a block that breaks after its name went out
stays a call, with the argument text sent so far, where the whole reply would keep the block as
content. With `required` or a named function the grammar rules that out.)

A reply cut by `max_tokens` inside a block is answered as vLLM answers it: finish "length" with
the partial call (its name and the argument text so far) in `tool_calls`, whole or streamed, and
never the block's markup in the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    calls: list[ToolCall]


def parse_block(body: str) -> ToolCall | None:
    """The call in one block's text (between the tags), or None when it is not one."""
    head = _NAME.match(body)
    if head is None:
        return None
    try:
        name = json.loads(f'"{head.group(1)}"')
        arguments, end = _DECODER.raw_decode(body, head.end())
    except ValueError:
        return None
    if not isinstance(arguments, dict) or body[end:].strip() != "}":
        return None
    return ToolCall(name, body[head.end() : end])


def partial_call(body: str) -> ToolCall | None:
    """The call an unclosed block's text begins: its name once the block reaches `"arguments":`
    (else None), and the argument text written so far (just the arguments, once their object has closed)."""
    head = _NAME.match(body)
    if head is None:
        return None
    try:
        name = json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None
    args = body[head.end() :]
    try:
        _, end = _DECODER.raw_decode(args)
        args = args[:end]
    except ValueError:
        pass  # still open: every character so far is the arguments'
    return ToolCall(name, args)


def parse(
    text: str, max_calls: int | None = None, cut: bool = False, named: str | None = None
) -> ParsedReply:
    """The reply's content and calls (see the module docstring). With `max_calls` (the request's
    `parallel_tool_calls: false` makes it 1), what the model wrote after that many calls is
    dropped. A reply `cut` by `max_tokens` inside a block (or its opening tag) ends with the
    partial call, as vLLM answers (`partial_call`), never with the markup in the content; with
    a `named` tool_choice, a reply cut before any call is that function's call with no
    arguments yet."""
    content, calls, rest = [], [], text
    while (start := rest.find(OPEN)) >= 0 and (end := rest.find(CLOSE, start)) >= 0:
        if max_calls is not None and len(calls) >= max_calls:
            content.append(rest[:start])
            rest = ""
            break
        call = parse_block(rest[start + len(OPEN) : end])
        content.append(rest[:start] if call is not None else rest[: end + len(CLOSE)])
        if call is not None:
            calls.append(call)
        rest = rest[end + len(CLOSE) :]
    if cut:
        rest = rest[: len(rest) - _held(rest, 0, OPEN)]  # a cut opening tag
        start = rest.find(OPEN)
        if start >= 0:
            body = rest[start + len(OPEN) :]
            call = partial_call(body[: len(body) - _held(body, 0, CLOSE)])
            if call is not None and (max_calls is None or len(calls) < max_calls):
                calls.append(call)
            rest = rest[:start]
        if named is not None and not calls:
            calls.append(ToolCall(named, ""))
    text = ("".join(content) + rest).strip()
    return ParsedReply(text or None, calls)


@dataclass(slots=True)
class StreamPiece:
    """What one piece of a streamed reply adds: content text, and tool-call deltas (OpenAI's
    `delta.tool_calls` entries)."""

    content: str
    calls: list[dict[str, Any]]


class ToolStream:
    """Parses one choice's reply as it streams (see the module docstring). `feed` each piece of
    text; `finish` at the end releases what was held back. `called` says whether any call was
    sent (then the choice finishes with "tool_calls")."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # as in `parse`: after that many calls, the rest is dropped
        self._text = ""
        self._sent = 0  # content sent up to here, or the start of the open block
        self._block: int | None = None  # where the open block's body starts
        self._call: ToolCall | None = None  # the open block's call, once its name is sent
        self._args_sent = 0
        self.num_calls = 0
        self._dropping = False  # past `max_calls`: nothing more is sent

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, piece: str) -> StreamPiece:
        self._text += piece
        out = StreamPiece("", [])
        while True:
            if self.max_calls is not None and self._block is None and self.num_calls >= self.max_calls:
                start = self._text.find(OPEN, self._sent)
                if start >= 0:  # a call past the last one allowed: it and all after are dropped
                    out.content += self._text[self._sent : start]
                    self._sent = len(self._text)
                    self._dropping = True
                if self._dropping:
                    self._sent = len(self._text)
                    return out
            if self._block is None:
                start = self._text.find(OPEN, self._sent)
                if start < 0:
                    end = len(self._text) - _held(self._text, self._sent, OPEN)
                    out.content += self._text[self._sent : end]
                    self._sent = end
                    return out
                out.content += self._text[self._sent : start]
                self._block = self._sent = start + len(OPEN)
                continue
            end = self._text.find(CLOSE, self._block)
            # Still open: what may be the start of the closing tag is not the arguments'.
            upto = end if end >= 0 else len(self._text) - _held(self._text, self._block, CLOSE)
            body = self._text[self._block : upto]
            self._stream_call(body, end >= 0, out)
            if end < 0:
                return out
            if self._call is None:  # not a call: the block is content, as `parse` keeps it
                out.content += self._text[self._block - len(OPEN) : end + len(CLOSE)]
            self._sent = end + len(CLOSE)
            self._block, self._call, self._args_sent = None, None, 0

    def finish(self, cut: bool = False, named: str | None = None) -> StreamPiece:
        """The rest: held-back text, or an unclosed block's text as content when no call of it
        was sent. A reply `cut` by `max_tokens` keeps no markup: what was held back (an opening
        tag's start, a block whose name was not complete) is dropped, and with a `named`
        tool_choice a reply that sent no call yet sends that function's call, as `parse` does."""
        start = self._sent if self._block is None else self._block - len(OPEN)
        out = StreamPiece(self._text[start:] if self._call is None and not cut else "", [])
        self._sent = len(self._text)
        if cut and named is not None and not self.called:
            self._open(named, out)
        return out

    def _stream_call(self, body: str, closed: bool, out: StreamPiece) -> None:
        if closed:
            whole = parse_block(body)
            if whole is None:
                return
            if self._call is None:  # name and arguments came in one piece
                self._open(whole.name, out)
            out.calls += self._fragment(whole.arguments)
            return
        call = partial_call(body)
        if call is None:
            return
        if self._call is None:
            self._open(call.name, out)
        out.calls += self._fragment(call.arguments)

    def _open(self, name: str, out: StreamPiece) -> None:
        self._call = ToolCall(name, "")
        out.calls.append(
            {
                "index": self.num_calls,
                "id": self._call.id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )
        self.num_calls += 1

    def _fragment(self, args: str) -> list[dict[str, Any]]:
        if len(args) <= self._args_sent or not args.startswith(self._call.arguments):
            return []
        piece = args[self._args_sent :]
        self._args_sent = len(args)
        self._call.arguments = args
        return [{"index": self.num_calls - 1, "function": {"arguments": piece}}]


def _held(text: str, start: int, tag: str) -> int:
    """How many characters at the end of `text[start:]` could begin `tag`."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
