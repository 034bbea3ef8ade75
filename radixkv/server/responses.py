"""OpenAI's response bodies: completions and chat, whole and as stream chunks.

A finished choice or a streamed piece carries its text, its finish reason and, when asked for,
its tokens' logprobs, in the shape of its endpoint: completions list `tokens`,
`token_logprobs`, `top_logprobs` (token -> logprob) and `text_offset`; chat lists `content`
entries of `token`, `logprob`, `bytes` and `top_logprobs`. A token is shown as its text, or as
"token_id:N" with `return_tokens_as_token_ids` (which is how a client learns the exact ids, as
`radixkv replay --url` does) or for a model without a tokenizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixkv.outputs import TokenLogprob


@dataclass(slots=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)  # kept for the chat reply store


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

    def __init__(self, request_id: str, chat: bool, model: str, tokenizer: Any, token_ids: bool) -> None:
        self.request_id = request_id
        self.chat = chat
        self.model = model
        self.tokenizer = tokenizer
        self.token_ids = token_ids or tokenizer is None
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # streamed completions: text offset per choice so far

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [self._choice(c) for c in choices],
            "usage": usage.as_dict(),
        }

    def chunk(self, choice: Choice, first: bool = False) -> dict[str, Any]:
        """A stream chunk with one choice's new piece; `first` opens a chat reply with its role."""
        body: dict[str, Any] = {"index": choice.index}
        if self.chat:
            body["delta"] = (
                {"role": "assistant", "content": choice.text} if first else {"content": choice.text}
            )
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
            return {
                "index": choice.index,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": self._logprobs(choice),
                "finish_reason": choice.finish_reason,
            }
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": self._logprobs(choice),
            "finish_reason": choice.finish_reason,
        }

    def _logprobs(self, choice: Choice) -> dict[str, Any] | None:
        records = choice.logprobs
        if records is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(r) for r in records], "refusal": None}
        tokens = [self._token(r.token_id) for r in records]
        offset = self._offsets.get(choice.index, 0)
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[choice.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{self._token(t): lp for t, lp in r.top} for r in records],
            "text_offset": offsets,
        }

    def _chat_entry(self, record: TokenLogprob) -> dict[str, Any]:
        token = self._token(record.token_id)
        return {
            "token": token,
            "logprob": record.logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": (t := self._token(i)), "logprob": lp, "bytes": list(t.encode())}
                for i, lp in record.top
            ],
        }

    def _token(self, token_id: int) -> str:
        if self.token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])
