"""An engine replica of `serve --replicas` without a Ray cluster: the single server's options
(keys, per-key cache isolation, the body limit) hold in it, since each replica serves the
server's own application with them."""

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from radixkv.cluster.asgi_call import Forwarded
from radixkv.cluster.deployment import EngineReplica
from radixkv.config import EngineConfig

CONFIG = EngineConfig(model="tiny-llama", kv_cache_memory="8MiB", max_model_len=1024)
PROMPT = list(range(10, 50))


def replica(cache_isolation: str):
    options = {"api_key": ("key-a", "key-b"), "max_request_bytes": 2048, "cache_isolation": cache_isolation}
    return EngineReplica.func_or_class(CONFIG, "tiny", options)


async def post(served, key: str, prompt: list[int]) -> tuple[int, dict]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode()
    headers = [("authorization", f"Bearer {key}"), ("content-type", "application/json")]
    request = Forwarded("POST", "/v1/completions", b"", headers, body)
    head, *chunks = [part async for part in served.forward(request)]
    return head.status, json.loads(b"".join(chunks))


@pytest.mark.parametrize("isolation", ["per-key", "shared"])
def test_a_replica_keeps_each_key_s_prefixes_apart_and_refuses_a_body_over_its_limit(isolation):
    served = replica(isolation)

    async def main():
        replies = [await post(served, key, PROMPT) for key in ("key-a", "key-b", "key-a")]
        return replies, await post(served, "key-a", list(range(1000)))  # about 5 kB of JSON

    try:
        replies, big = asyncio.run(main())
    finally:
        asyncio.run(served.engine.shutdown())
    assert [status for status, _ in replies] == [200, 200, 200]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for _, r in replies]
    reused = len(PROMPT) - 1  # all but the last prompt token, whose logits are needed
    assert cached == ([0, 0, reused] if isolation == "per-key" else [0, reused, reused])
    assert big[0] == 413 and big[1]["error"]["code"] == "too_large"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "2", "--max-request-bytes", "0"], "--max-request-bytes"),
        (["--replicas", "2", "--max-waiting", "-1"], "--max-waiting"),
    ],
)
def test_serve_with_replicas_checks_the_server_s_options_before_any_replica_starts(flags, named, capsys):
    from radixkv.cli import main

    assert main(["serve", *flags]) == 2
    assert named in capsys.readouterr().err
