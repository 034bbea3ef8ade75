"""Chat prompts that find the KV of the conversation before them.

An OpenAI client sends the whole conversation every turn, its earlier replies as text. Tokenizing
a reply's text again need not give the ids the model generated (a byte-level model's reply need
not even be valid UTF-8; a BPE tokenizer may merge differently), and then the prompt leaves the
cached prefix at the first reply. So the server keeps the generated ids of its recent replies,
keyed by their text (`ReplyStore`), and renders a conversation with each known reply's ids
spliced in its place (`render_chat`), as `ChatSession` does in process. Turn k then extends
turn k-1's prompt and reply token for token, and finds them all in the prefix cache.

Also what a chat template takes: the messages (`template_message`: assistant tool calls with
their arguments as objects, a tool reply with its call's id) and the tools (`template_tools`).
`render` is the chat endpoints' one call into this room, in a worker thread.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from radixkv.conversation import render_chat
from radixkv.server.errors import APIError
from radixkv.server.protocol import ChatMessage, Tool


class ReplyStore:
    """The ids of the last `capacity` replies, by cache namespace (`cache_salt`) and text; the
    oldest go first. Kept apart by namespace, since whether a text splices in as other ids would
    tell a client (through `prompt_tokens`) that another tenant was given that reply."""

    def __init__(self, tokenizer: Any, capacity: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._ids: OrderedDict[tuple[str | None, str], list[int]] = OrderedDict()
        self._special = set(tokenizer.all_special_ids)

    def add(self, text: str, token_ids: list[int], namespace: str | None = None) -> None:
        """Remembers a finished reply. A closing special token (EOS) is left out, since the chat
        template closes the turn itself; a reply whose ids do not decode to its text (a stop
        string cut it) is not kept, since splicing its ids would change the conversation."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self._special else token_ids
        if not text or self.tokenizer.decode(ids, skip_special_tokens=True) != text:
            return
        key = (namespace, text)
        self._ids[key] = list(ids)
        self._ids.move_to_end(key)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def get(self, text: str, namespace: str | None = None) -> list[int] | None:
        return self._ids.get((namespace, text))


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[ChatMessage],
    replies: ReplyStore,
    namespace: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids for a chat request: the template (given `tools`, if any) with the
    generation prompt, known plain assistant replies of the same cache namespace as their
    generated ids (a reply that made tool calls is rendered by the template from its calls)."""
    if tokenizer is None or tokenizer.chat_template is None:
        raise APIError.bad_request("messages", "this model has no chat template: use /v1/completions")
    shown = [template_message(m) for m in messages]
    known = {
        i: ids
        for i, m in enumerate(shown)
        if m["role"] == "assistant"
        and "tool_calls" not in m
        and (ids := replies.get(m["content"], namespace))
    }
    return render_chat(tokenizer, shown, known, tools)


def render(
    tokenizer: Any,
    messages: list[ChatMessage],
    replies: ReplyStore,
    namespace: str | None,
    tools: list[Tool] | None,
    limit: tuple[int | None, int],
) -> tuple[list[int], list[dict[str, Any]] | None]:
    """A chat request's prompt ids, and its tools as the template took them (None without).
    First a check that needs neither template nor tokenizer: `limit` is (`max_prompt_chars`,
    `max_model_len`), and text longer than the first is a 400 naming `messages`."""
    chars = sum(len(m.content or "") for m in messages)
    max_chars, max_model_len = limit
    if max_chars is not None and chars > max_chars:
        raise APIError.text_too_long("messages", chars, max_model_len)
    shown = template_tools(tools) if tools else None
    return chat_prompt_ids(tokenizer, messages, replies, namespace, shown), shown


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """`tools` as a chat template takes them."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def template_message(message: ChatMessage) -> dict[str, Any]:
    """One message as a chat template takes it: assistant tool calls with their arguments as
    objects (Qwen2.5's template writes them with `tojson`), a tool reply with its call's id."""
    out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # rendered as the string it is
