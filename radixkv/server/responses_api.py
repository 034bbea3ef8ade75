"""`POST /v1/responses`: OpenAI's Responses API, as vLLM serves it, on top of the chat path.

A request is translated to a chat completion (`ResponsesRequest.as_chat`): `instructions` is a
system message before `input` (a string: one user message; or message items whose content is a
string or `input_text` parts, and the `function_call` / `function_call_output` items of an
earlier tool round, which become an assistant's tool calls and the tool's replies),
`max_output_tokens` is `max_tokens`, `text.format` is `response_format`, and the function tools
(`{"type": "function", "name", "description", "parameters"}`) and `tool_choice` take the chat
shapes. The chat path (`handlers.run`) then does everything else, so both endpoints validate,
template, constrain and parse tool calls the same way; its answer is reshaped here
(`response_object`, `ResponseEvents`).

The answer is a `response` object whose `output` holds a `message` item with one `output_text`
part (when the reply has text, or made no call) and one `function_call` item per call; a reply
cut by `max_output_tokens` has status `incomplete` with `incomplete_details.reason`
`max_output_tokens`. Streamed, it is the Responses events (`response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` ... `.done`, `response.function_call_arguments.delta` ... `.done`,
`response.output_item.done`, then `response.completed` with the whole object, whatever its
status, as vLLM ends it), each numbered by `sequence_number`.

Nothing is stored: `store: true`, `previous_response_id`, `background`, `conversation`, `prompt`
and `include` are refused with a 400 naming them, and so are the fields radixkv cannot honour
(`top_logprobs`, `truncation: "auto"`), rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from radixkv.server import handlers
from radixkv.server.errors import APIError, from_validation
from radixkv.server.protocol import ChatCompletionRequest, FunctionDef, Int64
from radixkv.server.state import ServerState


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class InputText(_Part):
    """A content part: the user's `input_text`, or an earlier assistant reply's `output_text`."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Part):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Part):
    """An earlier call the model made, sent back with the history."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text


class FunctionCallOutputItem(_Part):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(FunctionDef):
    """A function tool in the Responses shape: the chat shape's `function` fields at the top."""

    type: Literal["function"]


class NamedTool(_Part):
    type: Literal["function"]
    name: str


class TextFormat(_Part):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Part):
    format: TextFormat | None = None


class ResponsesRequest(_Part):
    """`POST /v1/responses` (see the module docstring)."""

    model: str | None = None
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    user: str | None = None
    # Refused when set (nothing is stored; see `check_supported`).
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    include: list[str] | None = None
    top_logprobs: Int64 | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def check_supported(self) -> None:
        """Raises a 400 naming the first field set to something radixkv cannot honour."""
        refused = {
            "store": (self.store, "responses are not stored: set store to false"),
            "previous_response_id": (
                self.previous_response_id,
                "responses are not stored: send the whole conversation in input",
            ),
            "background": (self.background, "background responses are not supported"),
            "conversation": (self.conversation, "conversations are not stored: send the whole one in input"),
            "prompt": (self.prompt, "stored prompt templates are not supported"),
            "include": (self.include, "include is not supported"),
            "top_logprobs": (self.top_logprobs, "top_logprobs is not supported on /v1/responses"),
            "truncation": (self.truncation == "auto", "truncation 'auto' is not supported"),
        }
        for name, (value, message) in refused.items():
            if value:
                raise APIError.bad_request(name, message)

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion this request asks for (see the module docstring). A value the
        chat body refuses (a `text.format.name` over 64 characters, say) is a 400 naming the
        chat field, which `create` renames to this endpoint's."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text})
                continue
            if isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
                continue
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if not messages or messages[-1]["role"] != "assistant" or "tool_calls" not in messages[-1]:
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
            messages[-1]["tool_calls"].append(call)  # a round's calls: one assistant message
        if not messages:
            raise APIError.bad_request("input", "input must hold at least one item")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedTool):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise from_validation(e) from e


# Chat parameters this endpoint spells otherwise, for the 400s the chat path raises.
_RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


async def create(state: ServerState, request: Request, body: ResponsesRequest, key: str | None) -> Response:
    """The answer to `body`, whole or streamed, sent with API key `key` (None without keys)."""
    body.check_supported()
    try:
        chat = body.as_chat()
        state.check_model(chat.model)
        answer = await handlers.run(state, request, chat, state.cache_salt(key, chat.cache_salt))
    except APIError as e:
        if e.param in _RENAMES:
            e.param = _RENAMES[e.param]
        raise
    shape = ResponseShape(body, state.model_name)
    if isinstance(answer, handlers.Streamed):
        return handlers.EventStream(shape.events(answer.chunks), answer.end)
    if isinstance(answer, Response):
        return answer
    (choice,) = answer["choices"]
    message = choice["message"]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    output = []
    if message["content"] is not None or not message.get("tool_calls"):
        output.append(shape.message_item(message["content"] or "", status))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(shape.call_item(call["id"], function["name"], function["arguments"], status))
    return JSONResponse(shape.response(output, choice["finish_reason"], answer["usage"]))


class ResponseShape:
    """The bodies of one response: its id, the request's settings it echoes, its items."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self.body = body
        self._sequence = 0

    def response(
        self, output: list[dict[str, Any]], finish: str | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The `response` object; `finish` None: still in progress (a stream's first events)."""
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        body = self.body
        tool_choice = body.tool_choice or "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            "parallel_tool_calls": body.parallel_tool_calls,
            "store": False,
            "metadata": {},
            "usage": None if usage is None else _usage(usage),
        }

    def message_item(self, text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
        parts = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
        return {
            "id": item_id or f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": parts,
        }

    def call_item(self, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {
            "id": f"fc_{call_id.removeprefix('call_')}",
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def event(self, kind: str, **fields: Any) -> str:
        """One SSE event of this response, numbered in the order sent."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return handlers.sse(payload, event=kind)

    async def events(self, chunks: AsyncIterator[dict[str, Any] | str]) -> AsyncIterator[str]:
        """The chat stream's chunks (one choice, its usage last) as Responses events. Text is
        held back while it is only whitespace, so a reply that is only a call gets no empty
        message item (as the whole answer's content is None then)."""
        yield self.event("response.created", response=self.response([], None, None))
        yield self.event("response.in_progress", response=self.response([], None, None))
        items = _Items(self)
        finish, usage = None, None
        async for chunk in chunks:
            if isinstance(chunk, str):
                continue  # the chat stream's `[DONE]`: `response.completed` ends this one
            if "error" in chunk:
                error = chunk["error"]
                yield self.event("error", code=error["code"], message=error["message"], param=error["param"])
                return
            if chunk.get("usage") is not None and not chunk["choices"]:
                usage = chunk["usage"]
                continue
            (choice,) = chunk["choices"]
            delta = choice["delta"]
            for event in items.text(delta.get("content") or ""):
                yield event
            for call in delta.get("tool_calls") or []:
                for event in items.call(call):
                    yield event
            finish = choice["finish_reason"] or finish
        for event in items.close(finish):
            yield event
        yield self.event("response.completed", response=self.response(items.done, finish, usage))


class _Items:
    """The output items of one streamed response as they open, grow and close."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.done: list[dict[str, Any]] = []  # closed items, in output order
        self._held = ""  # whitespace not yet sent: no message item is open
        self._message: dict[str, Any] | None = None  # the open message item
        self._text = ""  # the open message's text so far
        self._call: dict[str, Any] | None = None  # the open function_call item

    def text(self, piece: str) -> list[str]:
        if self._message is None:
            self._held += piece
            if not self._held.strip():
                return []
            piece, self._held = self._held, ""
            return self._open_message() + self._text_delta(piece)
        return self._text_delta(piece) if piece else []

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A chat `delta.tool_calls` entry: a call opening (its id and name) or more arguments."""
        out = self._close_message("completed")
        if "id" in delta:
            out += self._close_call("completed")
            function = delta["function"]
            self._call = self.shape.call_item(delta["id"], function["name"], "", "in_progress")
            out.append(self._added(self._call))
            return out
        piece = delta["function"]["arguments"]
        self._call["arguments"] += piece
        out.append(
            self.shape.event(
                "response.function_call_arguments.delta",
                item_id=self._call["id"],
                output_index=len(self.done),
                delta=piece,
            )
        )
        return out

    def close(self, finish: str | None) -> list[str]:
        """Closes what is open; a reply with no item at all gets its (whitespace) message."""
        status = "incomplete" if finish == "length" else "completed"
        out = []
        if not self.done and self._message is None and self._call is None:
            out += self._open_message() + (self._text_delta(self._held) if self._held else [])
        return out + self._close_message(status) + self._close_call(status)

    def _added(self, item: dict[str, Any]) -> str:
        return self.shape.event("response.output_item.added", output_index=len(self.done), item=item)

    def _open_message(self) -> list[str]:
        self._message, self._text = self.shape.message_item("", "in_progress"), ""
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": self._message["id"], "output_index": len(self.done), "content_index": 0}
        added = self._added(self._message)
        return [added, self.shape.event("response.content_part.added", **where, part=part)]

    def _text_delta(self, piece: str) -> list[str]:
        self._text += piece
        where = {"item_id": self._message["id"], "output_index": len(self.done), "content_index": 0}
        return [self.shape.event("response.output_text.delta", **where, delta=piece, logprobs=[])]

    def _close_message(self, status: str) -> list[str]:
        if self._message is None:
            return []
        text = self._text
        where = {"item_id": self._message["id"], "output_index": len(self.done), "content_index": 0}
        item = self.shape.message_item(text, status, self._message["id"])
        part = item["content"][0]
        self._message = None
        return self._item_done(
            item,
            self.shape.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.shape.event("response.content_part.done", **where, part=part),
        )

    def _close_call(self, status: str) -> list[str]:
        if self._call is None:
            return []
        call, self._call = self._call, None
        call["status"] = status
        done = self.shape.event(
            "response.function_call_arguments.done",
            item_id=call["id"],
            output_index=len(self.done),
            arguments=call["arguments"],
        )
        return self._item_done(call, done)

    def _item_done(self, item: dict[str, Any], *events: str) -> list[str]:
        out = [*events, self.shape.event("response.output_item.done", output_index=len(self.done), item=item)]
        self.done.append(item)
        return out


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat `usage` in the Responses shape."""
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }
