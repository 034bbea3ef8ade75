"""The FastAPI application: routes, authorization, error shapes and the engine's lifetime.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses` (OpenAI's
Responses API on the chat path: `radixkv.server.responses_api`), `GET /v1/models`,
`DELETE /v1/sessions/{session_id}` (closes a chat session: `radixkv.server.sessions`), `GET /health`,
`GET /metrics`, `GET /dashboard` and its data (`radixkv.server.dashboard_routes`). With an API
key, the `/v1` and `/dashboard` routes need `Authorization: Bearer <key>`; health and
metrics stay open for probes and scrapers, as in vLLM. Bodies are parsed by the request models
(strict types), not by FastAPI's lenient coercion, so a malformed body or a wrong JSON type is a
400 naming the field and never reaches the engine. Every error, routing ones included, has
OpenAI's shape. While the application runs, a task closes the chat sessions idle past their
timeout. When it shuts down (after uvicorn's graceful period), the engine aborts what is still
going and stops its loop thread.

Hostile traffic: a body over `max_request_bytes` is a 413 before more of it is read
(`radixkv.server.body`). Every response carries `x-request-id`, and an unexpected error is
logged under it and answered without its text (`radixkv.server.request_ids`). `/health` answers
503 once the engine's loop has died, so that a supervisor restarts the server.

Also served: `GET /v1/models/{id}`, `GET /version`, the tokenizer routes
(`radixkv.server.tokenizer_routes`), and FastAPI's `/openapi.json` and `/docs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

import radixkv
from radixkv.server import handlers, responses_api
from radixkv.server.body import DEFAULT_MAX_REQUEST_BYTES, read_body
from radixkv.server.chat_prompt import ReplyStore
from radixkv.server.dashboard_routes import add_dashboard_routes
from radixkv.server.errors import APIError, from_validation
from radixkv.server.prometheus import CONTENT_TYPE, exposition
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.request_ids import RequestIds
from radixkv.server.sessions import DEFAULT_IDLE_TIMEOUT_S, SessionTracker
from radixkv.server.state import CACHE_ISOLATION, ServerState, api_keys, prompt_char_limit
from radixkv.server.tokenizer_routes import add_tokenizer_routes


def build_app(
    engine: Any,
    model_name: str,
    *,
    api_key: str | Sequence[str] | None = None,
    max_waiting: int | None = None,
    session_idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    cache_isolation: str = "shared",
) -> FastAPI:
    """The application serving `engine` (an `AsyncEngine`) as `model_name`; it shuts the engine
    down when it stops. `api_key`: one key or several; a key that is not printable ASCII is a
    ValueError (no HTTP header could carry it, so it could never match). `cache_isolation`
    "per-key" gives each key a cache namespace of its own. Chat sessions idle for
    `session_idle_timeout_s` are closed (0 or None: only by `DELETE /v1/sessions/{id}`)."""
    keys = api_keys(api_key)
    if cache_isolation not in CACHE_ISOLATION:
        raise ValueError(f"cache_isolation must be one of {CACHE_ISOLATION}, got {cache_isolation!r}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    replies = ReplyStore(engine.tokenizer) if engine.tokenizer is not None else None
    sessions = SessionTracker(engine.close_session, session_idle_timeout_s)
    state = ServerState(
        engine,
        model_name,
        keys,
        max_waiting,
        replies,
        sessions,
        created=int(time.time()),
        max_prompt_chars=prompt_char_limit(engine.tokenizer, engine.max_model_len),
        cache_isolation=cache_isolation,
    )
    render_metrics = exposition(lambda: {**engine.metrics(), "open_sessions": len(sessions)})

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
    app.add_middleware(RequestIds)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
        return error.response()  # a 405's `Allow` header included

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        body = await read_body(request, max_request_bytes)
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise from_validation(e) from e

    async def generation(
        request: Request, model: type[CompletionRequest | ChatCompletionRequest]
    ) -> Response:
        """The door of the generation endpoints: the key, the body (parsed and checked), the
        model, and the request's cache namespace; then `handlers.create`."""
        key = state.authorize(request.headers.get("authorization"))
        body = await parse(request, model)
        state.check_model(body.model)
        return await handlers.create(state, request, body, state.cache_salt(key, body.cache_salt))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, ChatCompletionRequest)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        key = state.authorize(request.headers.get("authorization"))
        body = await parse(request, responses_api.ResponsesRequest)
        return await responses_api.create(state, request, body, key)

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

    instance = uuid.uuid4().hex  # a new one each start: how a client tells that the server restarted

    @app.get("/version")
    async def version() -> dict:
        return {"version": radixkv.__version__, "instance": instance}

    add_tokenizer_routes(app, state, parse)
    app.state.dashboard = add_dashboard_routes(app, state)

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
    async def health() -> Response:
        if not engine.is_alive():
            return JSONResponse({"status": "engine dead"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        # In a thread: a core in its own process answers between steps, and a step may be long;
        # the event loop keeps streaming and answering /health meanwhile.
        return Response(await asyncio.to_thread(render_metrics), media_type=CONTENT_TYPE)

    return app
