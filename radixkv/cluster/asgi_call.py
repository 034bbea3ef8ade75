"""One HTTP request through an ASGI application in this process, its response as a stream of parts.

This is how a replica runs the single-engine server's application (`radixkv.server.app`) for a
request the router forwards to it: no second HTTP server, no socket, and every route, check and
error shape of the server as it is. The response comes back as a `ResponseHead` and then the
body's bytes as the application sends them, so Server-Sent Events stream through unchanged.

When the consumer stops early (the router's client went away, or the router was cancelled), the
application's next `receive()` reports `http.disconnect`, which is how the server learns that a
client left: it aborts the request's engine work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

CLEANUP_S = 5.0  # how long an application gets to end its work once the consumer stops

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class ResponseHead(NamedTuple):
    status: int
    headers: list[tuple[str, str]]


class Forwarded(NamedTuple):
    """An HTTP request as the router received it, to run on a replica."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[str, str]]
    body: bytes


async def call_asgi(app: ASGIApp, request: Forwarded) -> AsyncIterator[ResponseHead | bytes]:
    """Yields the response's head, then its body in the chunks the application sends."""
    parts: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    left = asyncio.Event()
    pending: list[dict[str, Any]] = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        parts.put_nowait(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query,
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: parts.put_nowait(None))
    try:
        while (message := await parts.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield ResponseHead(message["status"], headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
        task.result()  # the application's own exception, if it failed before responding
        raise RuntimeError(f"{request.method} {request.path}: the application ended without a response")
    finally:
        left.set()  # the application sees the client leave and ends its work
        await asyncio.wait({task}, timeout=CLEANUP_S)
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # retrieved: a failure after the response is the application's to log
