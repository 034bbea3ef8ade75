"""What the server holds beside the engine: its name, key, admission count, reply store and
open chat sessions."""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.excerpt import excerpt
from radixkv.server.chat_prompt import ReplyStore
from radixkv.server.errors import APIError
from radixkv.server.sessions import SessionTracker

RETRY_AFTER_S = 1
KEY_NAMESPACES = 64
CACHE_ISOLATION = ("shared", "per-key")


def api_keys(keys: str | Sequence[str] | None) -> tuple[str, ...]:
    """The keys a server accepts, checked: printable ASCII, since no HTTP header could carry
    anything else (such a key could never match). Raises ValueError."""
    keys = (keys,) if isinstance(keys, str) else tuple(keys or ())
    for key in keys:
        if not (isinstance(key, str) and key and key.isascii() and key.isprintable() and key.strip() == key):
            raise ValueError(
                "API keys must be printable ASCII without surrounding spaces: an HTTP header "
                "could never carry such a key, so it could never match"
            )
    return keys


def bearer_key(header: str | None) -> str | None:
    """The key an `Authorization: Bearer <key>` header gives, unchecked; None for no such header."""
    scheme, _, given = (header or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" and given.strip() else None


def cache_namespace(key: str | None, requested: str | None) -> str | None:
    """The cache salt of a request with its own `cache_salt` `requested`, sent under API key `key`
    when each key is a namespace of its own (None otherwise): a digest of the key, so the key
    itself is never held in the cache or its logs. The server and the router both key by it."""
    if key is None:
        return requested
    tenant = "key:" + hashlib.sha256(key.encode()).hexdigest()
    return tenant if requested is None else f"{tenant}\x1f{requested}"


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
    api_keys: tuple[str, ...] = ()
    max_waiting: int | None = None
    replies: ReplyStore | None = None
    sessions: SessionTracker | None = None
    in_flight: int = 0
    created: int = 0  # when the model was loaded, for /v1/models
    max_prompt_chars: int | None = None  # longer text cannot fit max_model_len (`prompt_char_limit`)
    cache_isolation: str = "shared"  # "per-key": each API key is a cache namespace of its own
    key_namespaces: dict[str, OrderedDict[str, None]] = field(default_factory=dict)  # `cache_salt`

    def authorize(self, header: str | None) -> str | None:
        """The key of `Authorization: Bearer <key>`, or a 401 unless it is one of the server's
        (None when the server has no keys). Every key is compared, in constant time each."""
        if not self.api_keys:
            return None
        given = (bearer_key(header) or "").encode("latin-1", errors="replace")
        matched = None
        for key in self.api_keys:
            if hmac.compare_digest(given, key.encode()):
                matched = key
        if matched is None:
            raise APIError(
                401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key"
            )
        return matched

    def cache_salt(self, key: str | None, requested: str | None) -> str | None:
        """The request's cache namespace (`cache_namespace`) under this server's isolation.
        Under per-key isolation, the namespaces a key's requests name with a `cache_salt` of their
        own are remembered (the last `KEY_NAMESPACES` per key), so that its dashboard shows them."""
        if self.cache_isolation != "per-key" or key is None:
            return cache_namespace(None, requested)
        namespace = cache_namespace(key, requested)
        if requested is not None:
            seen = self.key_namespaces.setdefault(key, OrderedDict())
            seen[namespace] = None
            seen.move_to_end(namespace)
            if len(seen) > KEY_NAMESPACES:
                seen.popitem(last=False)
        return namespace

    def namespaces_of(self, key: str) -> list[str]:
        """The cache namespaces key `key` has used under per-key isolation: its own, and those of
        its latest requests with a `cache_salt`."""
        return [cache_namespace(key, None), *self.key_namespaces.get(key, ())]

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {excerpt(model)} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def waiting(self) -> int:
        return max(0, self.in_flight - self.engine.num_running_seqs())

    def admit(self, sequences: int, session_id: str | None = None, param: str = "n") -> None:
        """Counts the request's sequences in (and the request into its session, if any), or
        answers 503 with Retry-After when they would make more than `max_waiting` wait (400 when
        they alone are more, since no retry could succeed: `param` names the field to blame).
        Every admission is paired with one `release`."""
        if self.max_waiting is not None and sequences > self.max_waiting:
            raise APIError.bad_request(
                param,
                f"the request has {sequences} sequences (prompts x n), more than the "
                f"{self.max_waiting} this server lets wait",
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
            self.sessions.admit(session_id)

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
