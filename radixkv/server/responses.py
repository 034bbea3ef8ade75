"""OpenAI's response bodies: completions and chat, whole and as stream chunks.

A finished choice or a streamed piece carries its text, its finish reason and, when asked for,
its tokens' logprobs, in the shape of its endpoint: completions list `tokens`,
`token_logprobs`, `top_logprobs` (token -> logprob) and `text_offset`; chat lists `content`
entries of `token`, `logprob`, `bytes` and `top_logprobs`. A token is spelled as
`radixkv.server.token_text` says: its text, `bytes:...` when its text is not the token, or
"token_id:N" with `return_tokens_as_token_ids` (which is how a client learns the exact ids, as
`radixkv replay --url` does) or for a model without a tokenizer.

Completions `echo` puts the prompt first: its text before the choice's, and, with `logprobs`,
its tokens first in the lists, the first one's logprob and alternatives null (it has no
context), as OpenAI and vLLM answer. vLLM's `prompt_logprobs` extra is a list per prompt token
(null first) of `{token_id: {"logprob", "rank", "decoded_token"}}`: on each completions choice,
and at the top of a chat response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixkv.outputs import TokenLogprob
from radixkv.server.token_text import TokenSpeller


@dataclass(slots=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)  # kept for the chat reply store
    prompt_ids: list[int] | None = None  # the choice's prompt (for echo)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when the engine was asked for them
    # Chat with tools: a whole reply's calls (`tools.ToolCall`; `text` is then the content or
    # None), or a stream piece's `delta.tool_calls` entries.
    tool_calls: list[Any] | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Formatter:
    """Bodies for one request: its id, endpoint (`chat` or not), model and token spelling."""

    def __init__(
        self,
        request_id: str,
        chat: bool,
        model: str,
        tokenizer: Any,
        token_ids: bool,
        *,
        echo: bool = False,
        echo_top: int | None = None,
        prompt_top: int | None = None,
    ) -> None:
        """`echo`: completions text starts with the prompt, and with `echo_top` (the request's
        `logprobs`) so do the logprob lists; `prompt_top`: vLLM's `prompt_logprobs` k."""
        self.request_id = request_id
        self.chat = chat
        self.model = model
        self.tokenizer = tokenizer
        self.speller = TokenSpeller(tokenizer, token_ids)
        self.echo = echo
        self.echo_top = echo_top
        self.prompt_top = prompt_top
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # streamed completions: text offset per choice so far

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        body = {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [self._choice(c) for c in choices],
            "usage": usage.as_dict(),
        }
        if self.chat and self.prompt_top is not None and choices:
            body["prompt_logprobs"] = self._prompt_logprobs(choices[0])
        return body

    def chunk(self, choice: Choice, first: bool = False) -> dict[str, Any]:
        """A stream chunk with one choice's new piece; `first` opens a chat reply with its role."""
        body: dict[str, Any] = {"index": choice.index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if choice.text or not choice.tool_calls:
                delta["content"] = choice.text
            if choice.tool_calls:
                delta["tool_calls"] = choice.tool_calls
            body["delta"] = delta
        else:
            body["text"] = choice.text
        body["logprobs"] = self._logprobs(choice)
        body["finish_reason"] = choice.finish_reason
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [body]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk with `stream_options.include_usage`: no choices, the whole usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage.as_dict()}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, choice: Choice) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            if choice.tool_calls:
                message["tool_calls"] = [call.as_dict() for call in choice.tool_calls]
            return {
                "index": choice.index,
                "message": message,
                "logprobs": self._logprobs(choice),
                "finish_reason": choice.finish_reason,
            }
        body = {
            "index": choice.index,
            "text": self._prompt_text(choice) + choice.text if self.echo else choice.text,
            "logprobs": self._echoed_logprobs(choice) if self.echo else self._logprobs(choice),
            "finish_reason": choice.finish_reason,
        }
        if self.prompt_top is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(choice)
        return body

    def _prompt_text(self, choice: Choice) -> str:
        return self.tokenizer.decode(choice.prompt_ids) if self.tokenizer is not None else ""

    def _echoed_logprobs(self, choice: Choice) -> dict[str, Any] | None:
        """The completions lists with the prompt's tokens first (`echo` with `logprobs`)."""
        generated = self._logprobs(choice)
        if generated is None:
            return None
        prompt = [None, *choice.prompt_logprobs[1:]]
        tokens = [self.speller.text(t) for t in choice.prompt_ids]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        k = self.echo_top
        return {
            "tokens": tokens + generated["tokens"],
            "token_logprobs": [r and r.logprob for r in prompt] + generated["token_logprobs"],
            "top_logprobs": [r and self.speller.top(r.top[:k]) for r in prompt] + generated["top_logprobs"],
            "text_offset": offsets + [offset + o for o in generated["text_offset"]],
        }

    def _prompt_logprobs(self, choice: Choice) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, the token and its `prompt_top`
        alternatives by id, each with its logprob, rank (1: most likely) and text."""
        out: list[dict[str, Any] | None] = []
        for record in choice.prompt_logprobs:
            if record is None:
                out.append(None)
                continue
            entry = {str(record.token_id): self._vllm_logprob(record.token_id, record.logprob, record.rank)}
            for rank, (token_id, logprob) in enumerate(record.top[: self.prompt_top], start=1):
                entry.setdefault(str(token_id), self._vllm_logprob(token_id, logprob, rank))
            out.append(entry)
        return out

    def _vllm_logprob(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.speller.text(token_id)}

    def _logprobs(self, choice: Choice) -> dict[str, Any] | None:
        records = choice.logprobs
        if records is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(r) for r in records], "refusal": None}
        tokens = [self.speller.text(r.token_id) for r in records]
        offset = self._offsets.get(choice.index, 0)
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[choice.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [self.speller.top(r.top) for r in records],
            "text_offset": offsets,
        }

    def _chat_entry(self, record: TokenLogprob) -> dict[str, Any]:
        spell = self.speller
        return {
            "token": spell.text(record.token_id),
            "logprob": record.logprob,
            "bytes": list(spell.bytes(record.token_id)),
            "top_logprobs": [
                {"token": spell.text(i), "logprob": lp, "bytes": list(spell.bytes(i))} for i, lp in record.top
            ],
        }
