"""What the server holds beside the engine: its name, key, admission count, reply store and
open chat sessions."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from radixkv.server.chat_prompt import ReplyStore
from radixkv.server.errors import APIError
from radixkv.server.sessions import SessionTracker

RETRY_AFTER_S = 1


@dataclass
class ServerState:
    """`max_waiting`: sequences (each prompt's samples or beams) the server lets wait for a slot
    before it answers 503. Waiting is counted as the sequences this server has in flight minus
    those the engine runs; the count rises when a request is admitted, in the event loop, so a
    burst cannot slip past it between two engine steps, and a request counts all its sequences,
    so one request with many prompts cannot either. `sessions` tracks the requests carrying a
    `session_id`."""

    engine: Any
    model_name: str
    api_key: str | None = None
    max_waiting: int | None = None
    replies: ReplyStore | None = None
    sessions: SessionTracker | None = None
    in_flight: int = 0
    created: int = 0  # when the model was loaded, for /v1/models
    max_prompt_chars: int | None = None  # longer text cannot fit max_model_len (`prompt_char_limit`)

    def check_text_length(self, chars: int, param: str) -> None:
        """A 400 naming `param` for prompt text too long to fit the model whatever its tokens."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError.bad_request(
                param, f"{param} has {chars} characters: more than {self.engine.max_model_len} tokens "
                f"(max_model_len) can spell, so it cannot fit"
            )

    def authorize(self, header: str | None) -> None:
        """401 unless `Authorization: Bearer <key>` matches (when the server has a key)."""
        if self.api_key is None:
            return
        scheme, _, key = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(
                401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key"
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def waiting(self) -> int:
        return max(0, self.in_flight - self.engine.metrics()["running_seqs"])

    def admit(self, sequences: int, session_id: str | None = None, param: str = "n") -> None:
        """Counts the request's sequences in (and the request into its session, if any), or
        answers 503 with Retry-After when they would make more than `max_waiting` wait (400 when
        they alone are more, since no retry could succeed: `param` names the field to blame).
        Every admission is paired with one `release`."""
        if self.max_waiting is not None and sequences > self.max_waiting:
            raise APIError.bad_request(
                param, f"the request has {sequences} sequences (prompts x n), more than the "
                f"{self.max_waiting} this server lets wait"
            )
        if self.max_waiting is not None and self.waiting() + sequences > self.max_waiting:
            raise APIError(
                503,
                f"the server is full: {self.max_waiting} requests already wait; retry shortly",
                type="server_error",
                code="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.in_flight += sequences
        if self.sessions is not None:
            self.sessions.expire()  # here too, for an app run without its lifespan (a replica)
            if session_id is not None:
                self.sessions.begin(session_id)

    def release(self, sequences: int, session_id: str | None = None) -> None:
        self.in_flight -= sequences
        if session_id is not None and self.sessions is not None:
            self.sessions.end(session_id)


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """Characters beyond which text needs more than `max_model_len` tokens: no token spells more
    characters than its vocabulary string has (byte-level and SentencePiece vocabularies write
    each character as at least one symbol), so `max_model_len` times the longest is a bound
    checked before tokenizing. None without a tokenizer."""
    if tokenizer is None:
        return None
    return max_model_len * max(len(token) for token in tokenizer.get_vocab())
