"""Chat sessions over HTTP: the `session_id` extra reaches the engine's `session` eviction policy,
and a session ends by `DELETE /v1/sessions/{id}` or by its idle timeout.

The HTTP checks run a real `radixkv serve` (the `openai` client sends `session_id` through
`extra_body`) with a pool of 12 blocks of 16 tokens, and read what the pool kept from the
`cached_tokens` that a conversation's next turn reports. Each conversation and each one-off
request fills 3 blocks, so four one-off requests after two conversations force 6 blocks out:
which 6 says how the server ranked them. `SessionTracker`'s own rules run on a fake clock.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
from test_server import KEY, metric, serve

from radixkv import AsyncEngine, EngineConfig
from radixkv.server.app import build_app
from radixkv.server.sessions import SessionTracker

SERVE_ARGS = ("--block-size", "16", "--kv-cache-memory", "96KiB", "--eviction", "session")
SERVE_ARGS += ("--api-key", KEY, "--served-model-name", "tiny")
MAX_TOKENS = 8


def ids(seed: int, n: int = 36) -> list[int]:
    """Random byte ids; the first differs per seed, so no two prompts share a block."""
    rng = random.Random(seed)
    return [seed % 256] + [rng.randrange(256) for _ in range(n - 1)]


def complete(client: openai.OpenAI, prompt: list[int], session: str | None = None) -> openai.types.Completion:
    extra = {"ignore_eos": True, **({"session_id": session} if session is not None else {})}
    return client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra
    )


def cached(client: openai.OpenAI, prompt: list[int], session: str | None) -> int:
    """The tokens of `prompt` the pool still holds, as a next turn extending it finds them."""
    out = complete(client, prompt + [1, 2, 3, 4], session)
    return out.usage.prompt_tokens_details.cached_tokens


def one_offs(client: openai.OpenAI) -> None:
    for seed in range(100, 104):
        complete(client, ids(seed))


def delete(url: str, session: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.delete(f"{url}/v1/sessions/{session}", headers=headers, timeout=30)


@pytest.fixture(scope="module")
def folder(model_folders):
    return model_folders["llama"]


def open_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.mark.slow
def test_a_live_session_outlives_one_offs_and_a_closed_one_gives_its_blocks_up(folder, tmp_path):
    a, b = ids(1), ids(2)
    with serve(folder, tmp_path / "serve.log", *SERVE_ARGS, "--session-idle-timeout", "0") as (url, _):
        client = open_client(url)
        complete(client, a, "a")
        complete(client, b, "b")
        assert delete(url, "b", key=None).status_code == 401
        closed = delete(url, "b")
        assert closed.status_code == 200, closed.text
        assert closed.json() == {"id": "b", "object": "session", "deleted": True}
        unknown = delete(url, "b")  # closed already
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "session_id"
        with pytest.raises(openai.BadRequestError, match="session_id"):
            complete(client, a, "")
        one_offs(client)
        # LRU would evict a, the oldest, first; the session policy evicts the closed b instead.
        assert cached(client, a, "a") >= len(a) - 4
        assert cached(client, b, "b") == 0


@pytest.mark.slow
def test_an_idle_session_is_closed_by_its_timeout(folder, tmp_path):
    """Live, b would outrank the one-off requests (the test above) and keep its blocks; closed
    by its timeout, it is the oldest of equals and goes first."""
    b = ids(2)
    with serve(folder, tmp_path / "serve.log", *SERVE_ARGS, "--session-idle-timeout", "0.5") as (url, _):
        client = open_client(url)
        complete(client, b, "b")
        # b's timeout passes with no request to notice it: the server's own task closes it.
        deadline = time.monotonic() + 30
        while metric(url, "radixkv_open_sessions") > 0:
            assert time.monotonic() < deadline, "the idle session was never closed"
            time.sleep(0.1)
        assert delete(url, "b").status_code == 404  # closed already
        one_offs(client)
        assert cached(client, b, "b") == 0


# ------------------------------------------------------------------ the tracker's rules


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tracker(timeout: float | None) -> tuple[SessionTracker, list[str], Clock]:
    closed: list[str] = []
    clock = Clock()
    return SessionTracker(closed.append, timeout, clock), closed, clock


def test_idle_sessions_expire_in_order_and_never_under_a_request_in_flight():
    sessions, closed, clock = tracker(10.0)
    sessions.begin("a")
    sessions.end("a")  # idle from 0
    clock.now = 2.0
    sessions.begin("b")  # in flight from 2
    clock.now = 4.0
    sessions.begin("c")
    sessions.end("c")  # idle from 4
    clock.now = 12.0
    assert sessions.expire() == ["a"] and closed == ["a"]
    clock.now = 30.0
    assert sessions.expire() == ["c"]  # b is still in flight
    sessions.end("b")
    clock.now = 39.0
    assert sessions.expire() == []
    clock.now = 40.0
    assert sessions.expire() == ["b"] and closed == ["a", "c", "b"] and len(sessions) == 0


def test_an_explicit_close_waits_for_the_requests_in_flight_and_a_new_turn_reopens():
    sessions, closed, clock = tracker(None)  # no timeout: only explicit closes
    assert not sessions.close("x")
    sessions.begin("x")
    sessions.begin("x")
    assert sessions.close("x") and closed == []
    sessions.end("x")
    assert closed == []
    sessions.end("x")
    assert closed == ["x"] and "x" not in sessions
    sessions.begin("x")  # the next turn opens it again
    assert sessions.close("x") and closed == ["x"]  # still in flight: not yet
    sessions.begin("x")  # a new turn while closing cancels the close
    sessions.end("x")
    sessions.end("x")
    assert closed == ["x"] and "x" in sessions
    clock.now = 1e9
    assert sessions.expire() == [] and sessions.check_interval_s is None


def test_a_negative_timeout_is_refused():
    with pytest.raises(ValueError, match="idle timeout"):
        SessionTracker(lambda s: None, -1.0)


def test_a_stream_whose_client_left_before_it_began_releases_its_admission(folder):
    """The client of a streamed request is gone while the response starts: Starlette cancels the
    response before the body generator runs (so the generator's own `finally` never does). The
    admission count and the session's request still end, and the engine request is aborted."""
    body = {"model": "tiny", "prompt": ids(7), "max_tokens": 64, "stream": True, "ignore_eos": True}
    body["session_id"] = "left-early"
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(0.05)  # a slow transport: the disconnect is seen before the body starts

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=folder, block_size=16, kv_cache_memory="96KiB"))
        app = build_app(engine, "tiny", session_idle_timeout_s=0)
        state = app.state.radixkv
        await app(scope, receive, send)
        assert state.in_flight == 0
        assert state.sessions.close("left-early") and "left-early" not in state.sessions
        deadline = time.monotonic() + 30
        while (m := engine.metrics())["running"] + m["waiting"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        metrics = engine.metrics()
        assert metrics["running"] + metrics["waiting"] == 0, "the engine request was not aborted"
        await engine.shutdown()

    asyncio.run(main())


def test_a_session_id_holding_a_slash_can_be_closed(folder):
    async def main() -> httpx.Response:
        engine = AsyncEngine(EngineConfig(model=folder, block_size=16, kv_cache_memory="96KiB"))
        app = build_app(engine, "tiny", session_idle_timeout_s=0)
        sessions = app.state.radixkv.sessions
        sessions.begin("team/7")
        sessions.end("team/7")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://radixkv") as client:
            response = await client.delete("/v1/sessions/team/7")
        await engine.shutdown()
        assert "team/7" not in sessions
        return response

    response = asyncio.run(main())
    assert response.status_code == 200 and response.json()["id"] == "team/7"
