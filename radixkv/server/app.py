"""The FastAPI application: routes, authorization, error shapes and the engine's lifetime.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`DELETE /v1/sessions/{session_id}` (closes a chat session: `radixkv.server.sessions`), `GET /health`,
`GET /metrics`. With an API key, the `/v1` routes need `Authorization: Bearer <key>`; health and
metrics stay open for probes and scrapers, as in vLLM. Bodies are parsed by the request models
(strict types), not by FastAPI's lenient coercion, so a malformed body or a wrong JSON type is a
400 naming the field and never reaches the engine. Every error, routing ones included, has
OpenAI's shape. While the application runs, a task closes the chat sessions idle past their
timeout. When it shuts down (after uvicorn's graceful period), the engine aborts what is still
going and stops its loop thread.

Also served: `GET /v1/models/{id}`, `GET /version`, the tokenizer routes
(`radixkv.server.tokenizer_routes`), and FastAPI's `/openapi.json` and `/docs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

import radixkv
from radixkv.server import handlers
from radixkv.server.chat_prompt import ReplyStore
from radixkv.server.errors import APIError, from_validation
from radixkv.server.prometheus import CONTENT_TYPE, exposition
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.sessions import DEFAULT_IDLE_TIMEOUT_S, SessionTracker
from radixkv.server.state import ServerState
from radixkv.server.tokenizer_routes import add_tokenizer_routes

log = logging.getLogger("radixkv.server")


def build_app(
    engine: Any,
    model_name: str,
    *,
    api_key: str | None = None,
    max_waiting: int | None = None,
    session_idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
) -> FastAPI:
    """The application serving `engine` (an `AsyncEngine`) as `model_name`; it shuts the engine
    down when it stops. Chat sessions idle for `session_idle_timeout_s` are closed (0 or None:
    only by `DELETE /v1/sessions/{id}`)."""
    replies = ReplyStore(engine.tokenizer) if engine.tokenizer is not None else None
    sessions = SessionTracker(engine.close_session, session_idle_timeout_s)
    state = ServerState(engine, model_name, api_key, max_waiting, replies, sessions, created=int(time.time()))
    render_metrics = exposition(engine.metrics)

    async def expire_sessions(every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            sessions.expire()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        every_s = sessions.check_interval_s
        expiry = asyncio.create_task(expire_sessions(every_s)) if every_s is not None else None
        try:
            yield
        finally:
            if expiry is not None:
                expiry.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await expiry
            await engine.shutdown()

    app = FastAPI(title="radixkv", version=radixkv.__version__, lifespan=lifespan, redoc_url=None)
    app.state.radixkv = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        state.authorize(request.headers.get("authorization"))
        return await handlers.create(state, request, await _parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state.authorize(request.headers.get("authorization"))
        return await handlers.create(state, request, await _parse(request, ChatCompletionRequest))

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        state.authorize(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card()]}

    def model_card() -> dict:
        return {
            "id": model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "radixkv",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models/{model_id:path}")  # an id may hold "/"
    async def model(request: Request, model_id: str) -> dict:
        state.authorize(request.headers.get("authorization"))
        state.check_model(model_id)
        return model_card()

    @app.get("/version")
    async def version() -> dict:
        return {"version": radixkv.__version__}

    add_tokenizer_routes(app, state, _parse)

    @app.delete("/v1/sessions/{session_id:path}")  # an id may hold "/"
    async def close_session(request: Request, session_id: str) -> dict:
        """Closes the chat session now, or when its requests in flight end."""
        state.authorize(request.headers.get("authorization"))
        if not sessions.close(session_id):
            raise APIError(
                404,
                f"no open chat session {session_id!r} (never seen, or already closed)",
                param="session_id",
                code="session_not_found",
            )
        return {"id": session_id, "object": "session", "deleted": True}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(), media_type=CONTENT_TYPE)

    return app


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation(e) from e
