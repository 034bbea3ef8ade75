"""Every response carries `x-request-id`: the client's own when it sent one, else a new one.

The id is what a client quotes and what the server logs under. An unexpected error is handled
here, outermost: its traceback goes to the log under the id, once, and the client gets a 500 with
the error's type, a generic message and the id, never the exception's text (which can hold
another request's data). A pure ASGI middleware, so that streamed responses and errors raised
before any route runs carry the header too.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

log = logging.getLogger("radixkv.server")

HEADER = "x-request-id"
MAX_CLIENT_ID = 256  # a longer client id is replaced: it would be echoed and logged


def request_id(scope: dict[str, Any]) -> str:
    """The id of the request `scope` belongs to (set by `RequestIds`)."""
    return scope.get("state", {}).get("request_id") or "-"


class RequestIds:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = next((v for k, v in scope["headers"] if k == HEADER.encode()), b"")
        try:
            given = sent.decode("ascii")
        except UnicodeDecodeError:
            given = ""
        rid = given if given and len(given) <= MAX_CLIENT_ID and given.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()]
                message = {**message, "headers": [*headers, (HEADER.encode(), raw)]}
            await send(message)

        started = False

        async def send_tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_with_id(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as error:
            log.exception("request %s: unexpected %s on %s", rid, type(error).__name__, scope.get("path"))
            if started:  # the response is under way: nothing more can be said to the client
                return
            body = json.dumps(
                {
                    "error": {
                        "message": f"internal error; quote request id {rid}",
                        "type": "server_error",
                        "param": None,
                        "code": type(error).__name__,
                    }
                }
            ).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send_with_id({"type": "http.response.start", "status": 500, "headers": headers})
            await send_with_id({"type": "http.response.body", "body": body})
