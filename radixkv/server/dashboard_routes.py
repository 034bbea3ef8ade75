"""`GET /dashboard` (the live page) and `GET /dashboard/data` (its JSON), on the server's keys.

With API keys, both need one: as `Authorization: Bearer <key>`, or as `?key=` (a browser cannot
set a header when it opens a page; the page then keeps the key and sends it as the header).
Under `--cache-isolation per-key` a key's view holds only its own namespaces' part of the tree:
the key's own, and those its latest requests named with a `cache_salt` (`ServerState.cache_salt`
remembers them), with the per-session and per-namespace counts over that part. The counters and
block totals are the server's, as `/metrics` shows them to anyone. Nothing in either reveals
content: the tree snapshot names nodes by keyed hashes (`radixkv.dashboard.snapshot`).

The data is the engine's `dashboard` view through a `SnapshotCache`: however many pages poll,
the engine is asked at most once per `MAX_AGE_S` per scope, off the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from radixkv.cache.salt import salt_offset
from radixkv.dashboard.page import CSP, dashboard_page
from radixkv.dashboard.snapshot_cache import MAX_AGE_S, Scope, SnapshotCache
from radixkv.errors import EngineDeadError
from radixkv.server.errors import APIError
from radixkv.server.state import ServerState

POLL_MS = int(MAX_AGE_S * 1000)
NO_STORE = {"Cache-Control": "no-store"}


def add_dashboard_routes(app: FastAPI, state: ServerState) -> SnapshotCache:
    """Adds the two routes; returns the snapshot cache they share."""
    snapshots = SnapshotCache(lambda namespaces: state.engine.dashboard(namespaces))

    def scope(request: Request) -> Scope:
        header = request.headers.get("authorization")
        if header is None and "key" in request.query_params:
            header = "Bearer " + request.query_params["key"]
        key = state.authorize(header)
        if state.cache_isolation == "per-key" and key is not None:
            return tuple(salt_offset(ns) for ns in state.namespaces_of(key))
        return None

    @app.get("/dashboard")
    async def dashboard(request: Request) -> HTMLResponse:
        scope(request)
        headers = {**NO_STORE, "Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer"}
        return HTMLResponse(dashboard_page(POLL_MS), headers=headers)

    @app.get("/dashboard/data")
    async def dashboard_data(request: Request) -> JSONResponse:
        chosen = scope(request)
        if not state.engine.is_alive():
            raise APIError.engine_dead()
        try:
            view = await snapshots.get(chosen)
        except EngineDeadError as e:  # it died meanwhile
            raise APIError.engine_dead() from e
        body: dict[str, Any] = {
            "model": state.model_name,
            "scope": "all" if chosen is None else "namespace",
            "view": view,
            "history": snapshots.history.as_list(),
        }
        return JSONResponse(body, headers=NO_STORE)

    return snapshots
