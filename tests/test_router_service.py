"""The router's HTTP side without Ray: retries, a stream cut mid-way, no live replica, restarts,
the body limit and per-key routing.

The replicas here are scripted clients (a head, some chunks, then maybe a failure), since what is
under test is the router's handling of each fault; the real replicas on Ray Serve are driven in
tests/test_cluster.py.
"""

import asyncio
import json
import threading

import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from radixkv.cluster.asgi_call import ResponseHead
from radixkv.cluster.router_service import REPLICA_HEADER, ReplicaFailed, ReplicaInfo, RouterService
from radixkv.router import Router

SSE = [("content-type", "text/event-stream")]
JSON = [("content-type", "application/json")]


class Scripted:
    """A replica that answers every request with `parts`; a `ReplicaFailed` among them is raised
    there. `incarnation` None means it does not answer probes."""

    def __init__(self, parts, incarnation="a"):
        self.parts, self.incarnation, self.requests = parts, incarnation, []

    async def forward(self, request):
        self.requests.append(request)
        for part in self.parts:
            if isinstance(part, ReplicaFailed):
                raise part
            yield part

    async def probe(self):
        if self.incarnation is None:
            raise ReplicaFailed("no answer")
        return ReplicaInfo(self.incarnation, 64, 4)


def serve(replicas):
    service = RouterService(Router("round-robin", len(replicas), 64, 4), replicas, tokenizer=None)
    app = Starlette(routes=[Route("/{path:path}", service.handle, methods=["GET", "POST", "DELETE"])])
    return service, TestClient(app)


def completion(client, **body):
    return client.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 2, **body})


def test_a_replica_that_fails_before_answering_is_retried_once_elsewhere():
    ok = b'{"choices": []}'
    dead, alive = Scripted([ReplicaFailed("ActorDiedError")]), Scripted([ResponseHead(200, JSON), ok])
    service, client = serve([dead, alive])
    r = completion(client)
    assert (r.status_code, r.content, r.headers[REPLICA_HEADER]) == (200, ok, "1")
    assert json.loads(alive.requests[0].body)["prompt"] == [1, 2, 3, 4, 5]
    assert [s.alive for s in service.router.stats] == [False, True]
    assert [s.load for s in service.router.stats] == [0, 0]
    assert (service.counters.retries, service.counters.failures) == (1, [1, 0])
    assert completion(client).headers[REPLICA_HEADER] == "1"  # the dead one is out of routing


def test_when_the_retry_fails_too_the_client_gets_a_502_in_openai_shape():
    _, client = serve([Scripted([ReplicaFailed("gone")]), Scripted([ReplicaFailed("gone")])])
    r = completion(client)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "replica_failed"
    assert "failed while serving the request" in r.json()["error"]["message"]
    r = completion(client)
    assert (r.status_code, r.headers["retry-after"]) == (503, "1")
    assert r.json()["error"]["message"] == "no replica is alive to serve the request"


def test_a_stream_cut_mid_way_ends_with_an_error_event():
    parts = [ResponseHead(200, SSE), b'data: {"x": 1}\n\n', ReplicaFailed("ActorDiedError")]
    service, client = serve([Scripted(parts)])
    r = completion(client, stream=True)
    events = [line for line in r.text.split("\n\n") if line]
    assert events[0] == 'data: {"x": 1}'
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and "mid-stream" in error["message"]
    assert (service.router.stats[0].alive, service.router.stats[0].load) == (False, 0)


def test_probes_take_a_replica_out_and_back_and_a_restart_empties_its_index():
    replica = Scripted([ResponseHead(200, JSON), b"{}"])
    service, client = serve([replica])
    asyncio.run(service.probe_all())
    completion(client)
    assert service.router.indexes[0].match([1, 2, 3, 4, 5]) == 5
    replica.incarnation = None
    asyncio.run(service.probe_all())
    assert client.get("/health").status_code == 503
    replica.incarnation = "b"  # Ray started a new one
    asyncio.run(service.probe_all())
    assert client.get("/health").json() == {"status": "ok", "replicas_alive": 1}
    assert service.router.indexes[0].match([1, 2, 3, 4, 5]) == 0
    metrics = client.get("/metrics").text
    assert 'radixkv_router_failures_total{replica="0"} 1.0' in metrics
    assert 'radixkv_router_requests_total{replica="0"} 1.0' in metrics


@pytest.mark.parametrize("path", ["/v2/nothing", "/v1/embeddings"])
def test_unknown_routes_are_404_in_openai_shape(path):
    _, client = serve([Scripted([])])
    r = client.post(path, json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


CLOSED = b'{"id": "chat/7", "object": "session", "deleted": true}'
NOT_OPEN = b'{"error": {"message": "no open chat session", "code": "session_not_found"}}'


def test_a_session_close_goes_to_every_replica_and_is_a_200_if_any_had_it_open():
    without = Scripted([ResponseHead(404, JSON), NOT_OPEN])
    holder = Scripted([ResponseHead(200, JSON), CLOSED])
    service, client = serve([without, holder])
    r = client.delete("/v1/sessions/chat/7", headers={"authorization": "Bearer k"})
    assert (r.status_code, r.content, r.headers[REPLICA_HEADER]) == (200, CLOSED, "1")
    for replica in (without, holder):
        (sent,) = replica.requests
        assert (sent.method, sent.path) == ("DELETE", "/v1/sessions/chat/7")
        assert ("authorization", "Bearer k") in sent.headers
    assert [s.load for s in service.router.stats] == [0, 0]  # a close is no routed request


def test_a_session_no_replica_had_open_is_their_404_and_a_dead_replica_leaves_routing():
    dead = Scripted([ReplicaFailed("ActorDiedError")])
    without = Scripted([ResponseHead(404, JSON), NOT_OPEN])
    service, client = serve([dead, without])
    r = client.delete("/v1/sessions/s0")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert [s.alive for s in service.router.stats] == [False, True]
    assert service.counters.failures == [1, 0]
    without.parts = [ReplicaFailed("ActorDiedError")]
    r = client.delete("/v1/sessions/s0")
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    assert len(dead.requests) == 1  # out of routing: not asked again


def test_the_router_s_metrics_carry_each_live_replica_s_own_labelled_by_replica():
    """A scrape of the router gets its own counts and, after them, every live replica's engine
    metrics with a `replica` label; a replica out of routing is not asked, and one whose answer
    does not parse is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    from radixkv.metrics import prometheus_text

    def engine_metrics(hits: int) -> list:
        text = prometheus_text({"store_cache_hits": hits, "running": 1})
        return [ResponseHead(200, [("content-type", "text/plain")]), text.encode()]

    garbled = Scripted([ResponseHead(200, JSON), b'{"not": "prometheus"}'])
    replicas = [Scripted(engine_metrics(hits)) for hits in (5, 7, 100)] + [garbled]
    service, client = serve(replicas)
    service.router.set_alive(2, False)
    r = client.get("/metrics")
    assert r.status_code == 200
    samples = {
        (s.name, s.labels.get("replica")): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }
    assert samples[("radixkv_store_cache_hits_total", "0")] == 5
    assert samples[("radixkv_store_cache_hits_total", "1")] == 7
    assert ("radixkv_store_cache_hits_total", "2") not in samples and not replicas[2].requests
    assert samples[("radixkv_running", "1")] == 1
    assert ("radixkv_router_retries_total", None) in samples  # the router's own come first
    assert [q.path for q in replicas[0].requests] == ["/metrics"] == [q.path for q in garbled.requests]
    engines = {replica for name, replica in samples if not name.startswith("radixkv_router_")}
    assert engines == {"0", "1"}


def test_a_body_over_the_limit_is_a_413_at_the_router_and_reaches_no_replica():
    replica = Scripted([ResponseHead(200, JSON), b"{}"])
    service = RouterService(Router("round-robin", 1, 64, 4), [replica], tokenizer=None, max_request_bytes=64)
    client = TestClient(Starlette(routes=[Route("/{path:path}", service.handle, methods=["POST"])]))
    big = json.dumps({"prompt": list(range(40)), "max_tokens": 1}).encode()
    declared = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    chunked = client.post("/v1/completions", content=iter([big[:40], big[40:]]))  # no Content-Length
    for r in (declared, chunked):
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert not replica.requests and service.router.stats[0].requests == 0
    assert completion(client).status_code == 200  # a small one passes


class CountingTokenizer:
    """Encodes text as its bytes and notes the thread each call runs in."""

    chat_template = None

    def __init__(self):
        self.threads = []

    def encode(self, text, add_special_tokens=False):
        self.threads.append(threading.get_ident())
        return list(text.encode())


@pytest.mark.parametrize("per_key", [True, False])
def test_routing_keys_each_api_key_s_namespace_under_per_key_isolation(per_key):
    """Two keys with the same prompt: the cache-aware router expects a hit for a key's second
    request only, since the replicas cache each key apart; shared isolation expects it for both.
    The prompt's text is tokenized off the event loop."""
    replicas = [Scripted([ResponseHead(200, JSON), b"{}"]) for _ in range(2)]
    tokenizer = CountingTokenizer()
    router = Router("cache-aware", 2, 64, 4)
    service = RouterService(router, replicas, tokenizer, per_key_isolation=per_key)
    loop_threads = []

    async def handle(request):
        loop_threads.append(threading.get_ident())
        return await service.handle(request)

    client = TestClient(Starlette(routes=[Route("/{path:path}", handle, methods=["POST"])]))
    prompt = "the same long prompt, word for word"
    hits = []
    for key in ("key-a", "key-b", "key-a"):
        before = sum(s.estimated_hit_tokens for s in router.stats)
        r = client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 1},
            headers={"authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200
        hits.append(sum(s.estimated_hit_tokens for s in router.stats) - before)
    whole = len(prompt.encode())
    assert hits == ([0, 0, whole] if per_key else [0, whole, whole])
    assert len(tokenizer.threads) == len(loop_threads) == 3
    assert all(t != loop for t, loop in zip(tokenizer.threads, loop_threads, strict=True))
