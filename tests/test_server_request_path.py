"""How many of radixkv.server's modules a request body walks through before the engine sees it
(issue 48): a chat completion in at most 12 stays and 6 rooms.

A "room" is a module of `radixkv/server/`, a "stay" a maximal run of the request's work inside one
room. The walk is traced with `sys.setprofile` (every thread: templates and tokenization run in
worker threads) from the route's entry until the first call of the engine's `generate`, `stream`
or `beam_search`. A Python call into a server function starts a stay in its room, and a return to
a server caller starts one in the caller's; a coroutine that resumes after an `await` is where the
work goes on (the innermost of the frames resumed together, not each frame of its await chain), and
one that suspends is not a return. Calls outside the server (pydantic, the tokenizer, asyncio)
neither start nor end a stay.
"""

from __future__ import annotations

import asyncio
import dis
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import radixkv.server
from radixkv import AsyncEngine, EngineConfig
from radixkv.server import handlers
from radixkv.server.app import build_app

SERVER = str(Path(radixkv.server.__file__).parent)
RESUME = dis.opmap["RESUME"]
YIELD_VALUE = dis.opmap["YIELD_VALUE"]

CHAT = dict(
    model="tiny",
    messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}],
    max_tokens=4,
    temperature=0.5,
    seed=3,
    stop=["\n\n"],
    extra_body={"session_id": "s1", "cache_salt": "t1"},
)
COMPLETION = dict(model="tiny", prompt="Hello", max_tokens=4, temperature=0.5, seed=3, stop=["\n\n"])


def room(frame: Any) -> str | None:
    """The server module `frame` runs in, or None outside the server."""
    path = frame.f_code.co_filename
    return Path(path).stem if path.startswith(SERVER) else None


class Walk:
    """The rooms a request's work passes through, one entry per change of room (`stays`)."""

    def __init__(self) -> None:
        self.tracing = False
        self.stays: list[str] = []
        self._resumed: str | None = None  # the innermost frame of a resume not yet followed

    def enter(self, where: str | None) -> None:
        if where is not None and (not self.stays or self.stays[-1] != where):
            self.stays.append(where)

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if not self.tracing or event not in ("call", "return"):
            return
        code, at = frame.f_code.co_code, frame.f_lasti
        if event == "call":
            resumed = at >= 0 and code[at] == RESUME and code[at + 1] != 0  # oparg 0: a fresh call
            if resumed:
                self._resumed = room(frame) or self._resumed
                return
            self._commit()
            self.enter(room(frame))
            return
        self._commit()
        if at >= 0 and code[at] == YIELD_VALUE:  # a coroutine suspends: no return
            return
        if room(frame) is not None and frame.f_back is not None:
            self.enter(room(frame.f_back))

    def _commit(self) -> None:
        if self._resumed is not None:
            self.enter(self._resumed)
            self._resumed = None


class Traced:
    """The engine, with the walk stopped at its first request."""

    def __init__(self, engine: AsyncEngine, walk: Walk) -> None:
        self._engine, self._walk = engine, walk

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if name in ("generate", "stream", "beam_search"):
            self._walk.tracing = False
        return value


def walk_of(folder: Path, endpoint: str, body: dict[str, Any]) -> list[str]:
    """The stays of one request to `endpoint` ("chat/completions" or "completions") with `body`."""
    walk = Walk()

    async def main() -> list[str]:
        engine = AsyncEngine(EngineConfig(model=str(folder), block_size=4, kv_cache_memory="8MiB"))
        app = build_app(Traced(engine, walk), "tiny", session_idle_timeout_s=0)
        entry = handlers.create.__code__  # the handler the route hands the parsed body to

        def start(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code is entry and frame.f_lasti >= 0:
                walk.tracing = walk.tracing or not walk.stays
            walk.profile(frame, event, arg)

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://radixkv") as http:
            client = openai.AsyncOpenAI(base_url="http://radixkv/v1", api_key="x", http_client=http)
            create = (
                client.chat.completions.create
                if endpoint == "chat/completions"
                else (client.completions.create)
            )
            threading.setprofile(start)
            sys.setprofile(start)
            try:
                out = await create(**body)
                if body.get("stream"):
                    chunks = [chunk async for chunk in out]
                    finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
                else:
                    finish = out.choices[0].finish_reason
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
                await engine.shutdown()
        assert finish in ("stop", "length")  # it ran to the end
        return walk.stays

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_body_walks_the_server_in_at_most_12_stays_and_6_rooms(model_folders, stream):
    stays = walk_of(model_folders["llama"], "chat/completions", {**CHAT, "stream": stream})
    assert len(stays) <= 12 and len(set(stays)) <= 6, " -> ".join(stays)


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_body_walks_the_server_in_at_most_12_stays_and_6_rooms(model_folders, stream):
    stays = walk_of(model_folders["llama"], "completions", {**COMPLETION, "stream": stream})
    assert len(stays) <= 12 and len(set(stays)) <= 6, " -> ".join(stays)
