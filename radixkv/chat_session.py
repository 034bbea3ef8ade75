"""A chat session: each turn's prompt is the whole conversation, and reuses its KV.

The conversation's token ids grow turn by turn (`Conversation`): turn k's prompt is turn k-1's
prompt, the engine's own reply to it and the new message through the chat template, token for
token. The previous turn's prompt and reply were cached when that turn finished, so the new
turn's `num_cached_tokens` covers the whole earlier conversation but the template's few new
tokens. Sessions with the same system prompt share its blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, Protocol

from radixkv.conversation import Conversation
from radixkv.outputs import RequestOutput, StreamDelta
from radixkv.sampling_params import SamplingParams


class _SessionEngine(Protocol):
    """What a session of either kind reads of the engine it drives. Sessions are typed against
    these protocols, not the engines, so that the engines can import this module and not the
    other way round."""

    tokenizer: Any
    eos_token_ids: list[int]

    def decode(self, ids: list[int]) -> str: ...

    def close_session(self, session_id: str) -> None: ...


class ChatEngine(_SessionEngine, Protocol):
    """The blocking engine a `ChatSession` drives (`Engine`)."""

    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | None = None,
        session_id: str | None = None,
    ) -> list[RequestOutput]: ...

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, session_id: str | None = None
    ) -> Iterator[StreamDelta]: ...


class AsyncChatEngine(_SessionEngine, Protocol):
    """The engine an `AsyncChatSession` drives (`AsyncEngine`)."""

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, session_id: str | None = None
    ) -> RequestOutput: ...

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, *, session_id: str | None = None
    ) -> AsyncIterator[StreamDelta]: ...


_SESSION_IDS = itertools.count()


class _Session:
    """The conversation, how a reply joins it, and the session's life, for both session kinds.

    Its turns are tagged with `session_id`, so the `session` eviction policy keeps the
    conversation's blocks over one-off requests' until `close()` (or the end of a `with` block)."""

    def __init__(self, engine: _SessionEngine, system: str | list[int] | None) -> None:
        self.engine = engine
        self.conversation = Conversation(engine.tokenizer, system)
        self.session_id = f"chat-{next(_SESSION_IDS)}"
        self.closed = False

    def close(self) -> None:
        """No more turns: the conversation's cached blocks rank as a finished request's."""
        if not self.closed:
            self.closed = True
            self.engine.close_session(self.session_id)

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"chat session {self.session_id} is closed")

    @property
    def messages(self) -> list[dict[str, str]]:
        """The conversation as `{"role", "content"}` messages (text sessions)."""
        return self.conversation.messages

    def _record(self, reply: list[int], finish_reason: str | None) -> None:
        text = self.engine.decode(reply)
        if finish_reason == "stop" and reply and reply[-1] in self.engine.eos_token_ids:
            reply = reply[:-1]  # the chat template closes the turn itself
        self.conversation.add_reply(reply, text)


class ChatSession(_Session):
    """A chat session over an `Engine`; `with engine.chat() as chat:` closes it at the end."""

    engine: ChatEngine

    def __init__(self, engine: ChatEngine, system: str | list[int] | None = None) -> None:
        super().__init__(engine, system)

    def send(self, message: str | list[int], params: SamplingParams | None = None) -> RequestOutput:
        """Sends the user's message; returns the engine's reply. With n > 1 the first sample
        continues the conversation. A message the engine refuses leaves the session unchanged."""
        self._check_open()
        out = self.engine.generate([self.conversation.prompt(message)], params, self.session_id)[0]
        self._record(out.token_ids, out.finish_reason)
        return out

    def stream(self, message: str | list[int], params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Like `send`, but yields the reply token by token as it is made."""
        self._check_open()
        reply, reason = [], None
        for piece in self.engine.stream(self.conversation.prompt(message), params, self.session_id):
            if piece.token_id is not None:  # None: the closing delta of an aborted turn
                reply.append(piece.token_id)
            reason = piece.finish_reason
            yield piece
        self._record(reply, reason)


class AsyncChatSession(_Session):
    """`ChatSession` over an `AsyncEngine`: `await send(...)`, `async for piece in stream(...)`.
    A turn that is cancelled or fails leaves the conversation unchanged. `close()` only queues
    (`AsyncEngine.close_session`), so it never waits for a step."""

    engine: AsyncChatEngine

    async def send(self, message: str | list[int], params: SamplingParams | None = None) -> RequestOutput:
        self._check_open()
        prompt = self.conversation.prompt(message)
        out = await self.engine.generate(prompt, params, session_id=self.session_id)
        self._record(out.token_ids, out.finish_reason)
        return out

    async def stream(
        self, message: str | list[int], params: SamplingParams | None = None
    ) -> AsyncIterator[StreamDelta]:
        self._check_open()
        reply, reason = [], None
        prompt = self.conversation.prompt(message)
        async for piece in self.engine.stream(prompt, params, session_id=self.session_id):
            if piece.token_id is not None:  # None: the closing delta of an aborted turn
                reply.append(piece.token_id)
            reason = piece.finish_reason
            yield piece
        self._record(reply, reason)
