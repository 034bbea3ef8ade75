"""`/dashboard` and `/dashboard/data` over an in-process ASGI transport: keys (bearer or `?key=`),
per-key scopes, no content in what they return, a page that loads nothing from elsewhere, and
polls that share one engine call; and the `SnapshotCache` that makes them share it."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest
from test_hostile_server import Server

from radixkv.dashboard.snapshot_cache import SnapshotCache

SECRET_WORD = "zebracornflakes"  # in key A's prompts: must appear in no dashboard answer


@pytest.fixture
def per_key(model_folders):
    s = Server(
        model_folders["llama"], engine_process=False, api_key=["key-a", "key-b"], cache_isolation="per-key"
    )
    yield s
    s.close()


def data(server: Server, key: str | None = None, query: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    params = {"key": query} if query else {}
    return server.run(server.http.get("/dashboard/data", headers=headers, params=params))


def test_dashboard_needs_a_key_and_shows_each_key_only_its_namespace(per_key):
    for path in ("/dashboard", "/dashboard/data"):
        assert per_key.run(per_key.http.get(path)).status_code == 401
        assert per_key.run(per_key.http.get(path, params={"key": "nope"})).status_code == 401
        assert per_key.run(per_key.http.get(path, params={"key": "key-a"})).status_code == 200
    client = per_key.client("key-a")
    system = f"Every answer mentions {SECRET_WORD} exactly once, then stops."
    for question in ("one?", "two?", "three?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        per_key.run(client.chat.completions.create(model="tiny", messages=messages, max_tokens=2))
    time.sleep(0.3)  # past the snapshot cache's age: the next answers are built after the traffic
    a, b = data(per_key, "key-a"), data(per_key, query="key-b")
    for answer in (a, b):
        assert answer.status_code == 200 and answer.headers["cache-control"] == "no-store"
        assert SECRET_WORD not in answer.text
    a, b = a.json(), b.json()
    assert a["scope"] == b["scope"] == "namespace"
    nodes = a["view"]["tree"]["nodes"]
    assert len(nodes) >= 4 and sum(n["blocks"] for n in nodes) > 0  # a shared node, a branch each
    assert [n["parent"] for n in b["view"]["tree"]["nodes"]] == [None]  # B sees only the root
    assert b["view"]["tree"]["namespaces"] == {}
    assert a["view"]["blocks"] == b["view"]["blocks"]  # the server's totals, as /metrics shows them
    ids = per_key.engine.tokenizer.encode(system)
    longest = max(len(re.findall(r"\d+", json.dumps(n))) for n in nodes)
    assert longest < len(ids)  # no node carries a run of token ids


def test_dashboard_page_loads_nothing_from_elsewhere(per_key):
    page = per_key.run(per_key.http.get("/dashboard", headers={"Authorization": "Bearer key-b"}))
    assert page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert re.findall(r"""(?:src|href)\s*=\s*["'](?!data:)""", page.text) == []
    assert "<script src" not in page.text and "@import" not in page.text


def test_many_polls_share_one_engine_call(per_key):
    cache = per_key.app.state.dashboard

    async def polls():
        get = [
            per_key.http.get("/dashboard/data", headers={"Authorization": "Bearer key-a"}) for _ in range(12)
        ]
        return await asyncio.gather(*get)

    time.sleep(0.3)
    before = cache.fetches
    answers = per_key.run(polls())
    assert all(r.status_code == 200 for r in answers)
    assert cache.fetches - before == 1
    assert len({r.text for r in answers}) == 1


def test_snapshot_cache_coalesces_refreshes_by_age_and_scope_and_survives_failures():
    calls, gate = [], threading.Event()

    def fetch(namespaces):
        calls.append(namespaces)
        gate.wait(5)
        if namespaces == [13]:
            raise RuntimeError("the engine is gone")
        queries = 10 * len(calls)
        return {
            "metrics": {"prefix_cache_queries": queries, "prefix_cache_hits": len(calls)},
            "blocks": {"device": {"running": 0, "cached": 0, "free": 1}},
            "policy": None,
            "scope": namespaces,
        }

    async def scenario():
        cache = SnapshotCache(fetch, max_age_s=0.2, min_gap_s=0.05)
        waiters = [asyncio.ensure_future(cache.get(None)) for _ in range(5)]
        other = asyncio.ensure_future(cache.get((7,)))
        await asyncio.sleep(0.05)
        waiters[0].cancel()  # one poller leaving cancels nobody else's answer
        gate.set()
        answers = await asyncio.gather(*waiters[1:])
        assert all(a is answers[0] for a in answers) and (await other)["scope"] == [7]
        assert len(calls) == 2
        assert await cache.get(None) is answers[0]  # still fresh: no new call
        assert len(calls) == 2
        with pytest.raises(RuntimeError):
            await cache.get((13,))
        with pytest.raises(RuntimeError):  # a failure is not cached, and does not wedge the scope
            await cache.get((13,))
        await asyncio.sleep(0.25)
        fresh = await cache.get(None)
        assert fresh is not answers[0] and len(calls) == 5
        history = cache.history.as_list()
        assert len(history) == 2  # the call for scope (7,) came within max_age_s of the first

    asyncio.run(scenario())


def test_engine_calls_stay_apart_however_many_scopes_are_watched():
    """Fifty keys' pages at once: the engine is called `min_gap_s` apart, never all at once."""
    times: list[float] = []

    def fetch(namespaces):
        times.append(time.monotonic())
        return {"metrics": {"prefix_cache_queries": 0, "prefix_cache_hits": 0}, "blocks": {"device": {}}}

    async def scenario() -> float:
        cache = SnapshotCache(fetch, min_gap_s=0.02)
        start = time.monotonic()
        await asyncio.gather(*(cache.get((k,)) for k in range(50)))
        return time.monotonic() - start

    took = asyncio.run(scenario())
    assert len(times) == 50
    assert took >= 49 * 0.02  # each call waited its turn (load only makes it slower)


def test_a_dead_engine_is_a_503_on_the_dashboard(per_key, monkeypatch):
    monkeypatch.setattr(per_key.engine, "is_alive", lambda: False)
    answer = data(per_key, "key-a")
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_dead"


def test_a_keys_own_cache_salts_are_in_its_view_and_no_one_elses(per_key):
    messages = [{"role": "user", "content": "salted question, long enough to fill a few blocks"}]
    client = per_key.client("key-a")
    extra = {"cache_salt": "project-x"}
    per_key.run(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=extra)
    )
    time.sleep(0.3)
    a, b = data(per_key, "key-a").json(), data(per_key, "key-b").json()
    assert sum(n["blocks"] for n in a["view"]["tree"]["nodes"]) > 0
    assert len(a["view"]["tree"]["namespaces"]) == 1  # the salted namespace, A's own
    assert [n["parent"] for n in b["view"]["tree"]["nodes"]] == [None]


def test_policy_state_has_no_window_while_adaptive_runs_gdsf():
    from radixkv.cache.eviction import make_policy
    from radixkv.cache.miniature import GDSF_SETTING
    from radixkv.dashboard.cache_view import policy_state

    adaptive = make_policy("adaptive")
    adaptive.setting = GDSF_SETTING
    assert policy_state(adaptive) == {"name": "adaptive", "window_share": None, "setting": "gdsf"}
