"""`serve --replicas` without a Ray cluster: the single server's options reach every replica and
the router, they hold in a replica (keys, per-key cache isolation, the body limit: each replica
serves the server's own application with them), and bad ones are refused before Ray starts."""

import asyncio
import json

import pytest

from radixkv.cli import build_parser, main
from radixkv.cluster import launch
from radixkv.cluster.asgi_call import Forwarded
from radixkv.config import EngineConfig

CONFIG = EngineConfig(model="tiny-llama", kv_cache_memory="8MiB", max_model_len=1024)
PROMPT = list(range(10, 50))


async def post(served, key: str, prompt: list[int]) -> tuple[int, dict]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
    headers = [("authorization", f"Bearer {key}"), ("content-type", "application/json")]
    request = Forwarded("POST", "/v1/completions", b"", headers, body)
    head, *chunks = [part async for part in served.forward(request)]
    return head.status, json.loads(b"".join(chunks))


# Serve awaits the replica's `async def __del__` as it stops it; Python's own finalizer then calls
# it once more when `served` goes, and nothing awaits that second coroutine.
@pytest.mark.filterwarnings("ignore:coroutine 'EngineReplica.__del__' was never awaited:RuntimeWarning")
@pytest.mark.parametrize("isolation", ["per-key", "shared"])
def test_a_replica_keeps_each_key_s_prefixes_apart_and_refuses_a_body_over_its_limit(isolation):
    pytest.importorskip("ray.serve")
    from radixkv.cluster.deployment import EngineReplica

    options = {"api_key": ("key-a", "key-b"), "max_request_bytes": 2048, "cache_isolation": isolation}
    served = EngineReplica.func_or_class(CONFIG, "tiny", options)  # the class, outside Ray

    async def run():
        replies = [await post(served, key, PROMPT) for key in ("key-a", "key-b", "key-a")]
        return replies, await post(served, "key-a", list(range(1000)))  # about 5 kB of JSON

    try:
        replies, big = asyncio.run(run())
    finally:
        asyncio.run(served.__del__())  # as Serve stops a replica
    assert not served.engine.is_alive()
    assert [status for status, _ in replies] == [200, 200, 200]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for _, r in replies]
    reused = len(PROMPT) - 1  # all but the last prompt token, whose logits are needed
    assert cached == ([0, 0, reused] if isolation == "per-key" else [0, reused, reused])
    assert big[0] == 413 and big[1]["error"]["code"] == "too_large"


def test_serve_replicas_hands_the_server_options_to_the_application(monkeypatch):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from radixkv.cluster import deployment

    built = {}

    class Built(Exception):
        pass

    def build_application(*args, **kwargs):
        built.update(kwargs)
        raise Built  # nothing to deploy: what matters is what it was given

    monkeypatch.setattr(launch, "init_local_ray", lambda num_cpus: None)
    monkeypatch.setattr(ray, "cluster_resources", dict)
    monkeypatch.setattr(serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(deployment, "build_application", build_application)
    flags = ["--api-key", "k", "--cache-isolation", "per-key", "--max-request-bytes", "999"]
    flags += ["--max-waiting", "3"]
    with pytest.raises(Built):
        launch.run(build_parser().parse_args(["serve", "--replicas", "2", *flags]))
    assert built["api_key"] == ("k",) and built["max_waiting"] == 3
    assert (built["cache_isolation"], built["max_request_bytes"]) == ("per-key", 999)


def test_the_application_gives_replicas_the_server_options_and_the_router_its_own():
    pytest.importorskip("ray.serve")
    from radixkv.cluster.deployment import build_application

    app = build_application(
        CONFIG, 2, "cache-aware", "tiny", api_key=("k",), cache_isolation="per-key", max_request_bytes=999
    )
    engines, policy, _, service_options = app._bound_deployment.init_args  # Ray's record of .bind()
    assert policy == "cache-aware" and len(engines) == 2
    assert service_options == {"per_key_isolation": True, "max_request_bytes": 999}
    for engine in engines:
        _, name, server_options = engine._bound_deployment.init_args
        assert name == "tiny" and server_options["api_key"] == ("k",)
        assert (server_options["cache_isolation"], server_options["max_request_bytes"]) == ("per-key", 999)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "2", "--max-request-bytes", "0"], "--max-request-bytes"),
        (["--replicas", "2", "--max-waiting", "-1"], "--max-waiting"),
    ],
)
def test_serve_with_replicas_checks_the_server_s_options_before_any_replica_starts(
    flags, named, capsys, monkeypatch
):
    def started(num_cpus):
        raise AssertionError("Ray was started for options that should have been refused")

    monkeypatch.setattr(launch, "init_local_ray", started)
    assert main(["serve", *flags]) == 2
    assert named in capsys.readouterr().err
