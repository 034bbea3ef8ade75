"""Two engine replicas on Ray Serve behind the router, driven through the official `openai` client.

One local Ray instance for the whole module (about 35 s to start here, both engines included);
each test then takes a few seconds. Marked `cluster`: CI installs Ray with the test extra and
runs it; `-m "not cluster"` leaves it out.
"""

import contextlib
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
from processes import processes

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from radixkv.cluster.asgi_call import Forwarded  # noqa: E402
from radixkv.cluster.deployment import build_application  # noqa: E402
from radixkv.cluster.launch import init_local_ray  # noqa: E402
from radixkv.cluster.router_service import REPLICA_HEADER  # noqa: E402
from radixkv.config import EngineConfig  # noqa: E402

pytestmark = pytest.mark.cluster
IDLE_S = 2.0  # the replicas' session idle timeout
LIMIT = 64 * 1024  # bytes of a request body, at the router and at each replica


@pytest.fixture(scope="module")
def base_url():
    init_local_ray(4, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(model="tiny-llama", kv_cache_memory="8MiB", max_model_len=1024)
        app = build_application(
            config, 2, "cache-aware", "tiny-llama", session_idle_timeout_s=IDLE_S, max_request_bytes=LIMIT
        )
        serve.run(app, name="radixkv", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def router_metrics(base_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    found = re.findall(r'^(radixkv_router_\w+)(?:\{replica="(\d+)"\})? (\S+)$', text, re.M)
    return {f"{name}[{replica}]" if replica else name: float(value) for name, replica, value in found}


def chat_turn(client, messages):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return int(raw.headers[REPLICA_HEADER]), raw.parse()


def test_each_conversation_stays_on_one_replica_and_reuses_its_cache(client, base_url):
    placed = {}
    for c in range(4):
        messages = [{"role": "user", "content": f"Conversation {c}: tell me about the number {c * 7919}."}]
        replicas, previous_prompt = set(), 0
        for turn in range(3):
            replica, out = chat_turn(client, messages)
            replicas.add(replica)
            if turn:  # the previous prompt and its reply are in this replica's cache
                assert out.usage.prompt_tokens_details.cached_tokens >= previous_prompt
            previous_prompt = out.usage.prompt_tokens
            messages += [
                {"role": "assistant", "content": out.choices[0].message.content},
                {"role": "user", "content": f"And then, turn {turn}?"},
            ]
        assert len(replicas) == 1, f"conversation {c} moved between replicas {replicas}"
        placed[c] = replicas.pop()
    assert set(placed.values()) == {0, 1}, f"new conversations were not spread: {placed}"
    metrics = router_metrics(base_url)
    for i in (0, 1):
        assert metrics[f"radixkv_router_alive[{i}]"] == 1
        assert metrics[f"radixkv_router_requests_total[{i}]"] >= 6
        assert metrics[f"radixkv_router_in_flight[{i}]"] == 0
        # turns 2 and 3 of each conversation were routed expecting their earlier prompt cached
        assert metrics[f"radixkv_router_estimated_hit_tokens_total[{i}]"] > 0


def test_a_stream_through_the_router_equals_the_whole_reply_from_the_same_replica(client):
    messages = [{"role": "user", "content": "Stream this reply, please, for 53 tokens or so."}]
    replica, whole = chat_turn(client, messages)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert int(raw.headers[REPLICA_HEADER]) == replica  # the same prompt goes where it is cached
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 8)
    assert usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens - 16


def session_turn(client, text: str, session: str | None) -> int:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": text}],
        max_tokens=2,
        extra_body={"session_id": session} if session else None,
    )
    return int(raw.headers[REPLICA_HEADER])


def test_a_session_is_closed_through_the_router_by_delete_or_by_the_replicas_idle_timeout(client, base_url):
    # One replica holds the session, the other does not: the router's answer is the holder's 200.
    session_turn(client, "A session the client closes itself, 8111.", "closed/by-client")
    r = httpx.delete(f"{base_url}/v1/sessions/closed/by-client", timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True
    r = httpx.delete(f"{base_url}/v1/sessions/closed/by-client", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    # The replica got --session-idle-timeout: past it, its next request closes the idle session.
    text = "A session left idle, 9221."
    replica = session_turn(client, text, "idle")
    # Here the event is time itself: a replica runs without its lifespan, so nothing but the
    # next request notices an idle session; its timeout must have passed before that request.
    time.sleep(IDLE_S + 0.5)
    assert session_turn(client, text, None) == replica  # the cached prompt goes back to its replica
    assert httpx.delete(f"{base_url}/v1/sessions/idle", timeout=30).status_code == 404


def test_models_and_health_answer_through_the_router(client, base_url):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    health = urllib.request.urlopen(f"{base_url}/health", timeout=10).read().decode()
    assert '"replicas_alive":2' in health
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny-llama", prompt="hi", max_tokens=-1)


def test_the_replicas_run_at_normal_priority(base_url):
    """Ray would start them at niceness 15 (`WORKER_NICENESS` in `radixkv.cluster.launch`)."""
    assert [os.getpriority(os.PRIO_PROCESS, replica_pid(r)) for r in (0, 1)] == [0, 0]


def test_a_body_over_the_limit_is_a_413_at_the_router_and_at_each_replica(base_url):
    big = b'{"prompt": "' + b"x" * LIMIT + b'"}'
    routed = httpx.post(f"{base_url}/v1/completions", content=big, timeout=60)
    assert routed.status_code == 413 and routed.json()["error"]["code"] == "too_large"
    for replica in (0, 1):  # sent to the replica's deployment, past the router
        handle = serve.get_deployment_handle(f"engine-{replica}", app_name="radixkv")
        request = Forwarded("POST", "/v1/completions", b"", [], big)
        head, *_ = handle.options(stream=True).forward.remote(request)
        assert head.status == 413


def replica_metric(name: str, replica: int) -> float:
    """A gauge from replica `replica`'s own engine (its /metrics, sent through its Serve
    deployment, not the router): what runs there, not what the router has sent there."""
    handle = serve.get_deployment_handle(f"engine-{replica}", app_name="radixkv")
    parts = handle.options(stream=True).forward.remote(Forwarded("GET", "/metrics", b"", [], b""))
    text = b"".join(part for part in parts if isinstance(part, bytes)).decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def replica_pid(replica: int) -> int:
    """The process of replica `replica`'s engine: Ray titles each actor's worker process after its
    class and deployment (`ray::ServeReplica:radixkv:engine-1`). Only this test's cluster counts,
    whose processes descend from this one (its raylet is our child): another run's replicas on the
    same machine bear the same title."""
    title = f"ServeReplica:radixkv:engine-{replica}".encode()
    parents = {pid: parent for pid, (_, parent) in processes().items()}
    found = []
    for pid in parents:
        with contextlib.suppress(OSError):  # it ended while we looked
            if title in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    (pid,) = [p for p in found if ours(p)]
    return pid


def test_a_killed_replica_leaves_routing_its_requests_are_retried_and_it_comes_back(client, base_url):
    """SIGKILL lands while replica 1's own engine runs one of this test's requests: both engines
    are idle before the requests start, replica 1's gauge is polled from their start, each makes
    64 tokens (64 steps or more, a second even on a quiet machine), and the signal follows the
    reading with one call. Not more tokens: with both cores busy, 6 requests of 200 tokens beside
    the replica's restart (4 minutes there) all timed out at the clients' 400 s.

    The router's in-flight count would not do: it counts a request from the moment the router
    sends it, and Ray Serve re-sends a request that its replica had not yet accepted when it
    died to the replica's restart, so such a request succeeds without a retry by the router."""
    max_tokens = 64
    results, errors = [], []
    # Replica 0 serves all six at the end, beside replica 1's restart: minutes under heavy load.
    patient = client.with_options(timeout=400)

    def complete(k):
        try:
            raw = patient.completions.with_raw_response.create(
                model="tiny-llama",
                prompt=f"Request {k}: " + "lorem ipsum " * (k + 1),
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            results.append((int(raw.headers[REPLICA_HEADER]), raw.parse()))
        except Exception as e:
            errors.append(e)

    deadline = time.monotonic() + 60
    while replica_metric("radixkv_running", 0) or replica_metric("radixkv_running", 1):
        assert time.monotonic() < deadline, "an earlier test's request still runs"
        time.sleep(0.05)
    victim = replica_pid(1)
    threads = [threading.Thread(target=complete, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while replica_metric("radixkv_running", 1) < 1:
        assert time.monotonic() < deadline, "no request ran on replica 1"
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=420)
    assert not any(t.is_alive() for t in threads), "a request did not end"
    assert not errors, errors
    assert len(results) == 6
    assert all(out.choices[0].text and out.usage.completion_tokens == max_tokens for _, out in results)
    metrics = router_metrics(base_url)
    assert metrics["radixkv_router_failures_total[1]"] >= 1
    assert metrics["radixkv_router_retries_total"] >= 1, (metrics, [replica for replica, _ in results])
    # Ray restarts the replica; the router's probes take it back into routing. The restart is a
    # new worker process that builds its engine: with both cores busy it took over 90 s in three
    # CI runs in a row (4 minutes in one), so the wait ends as the clients' does.
    deadline = time.monotonic() + 420
    while router_metrics(base_url)["radixkv_router_alive[1]"] == 0:
        assert time.monotonic() < deadline, "replica 1 did not come back into routing"
        time.sleep(0.5)
    fresh = [f"{k * 104729} is where a new conversation starts after the restart" for k in range(4)]
    assert {chat_turn(client, [{"role": "user", "content": text}])[0] for text in fresh} == {0, 1}
