"""`radixkv replay --url` against a strict OpenAI-compatible server that is not radixkv: a fake
that answers 422 to any field it does not know (as `transformers serve` does), reports no
`cached_tokens` in `usage`, and counts prefix-cache hits in `/metrics` as vLLM names them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from radixkv.model.tokenizer import build_byte_tokenizer
from radixkv.tools.replay import summarize
from radixkv.tools.replay_http import Server, replay_url
from radixkv.workloads.format import Session, Turn, Workload

KNOWN = {"model", "prompt", "messages", "max_tokens", "temperature", "stream", "stream_options"}
REPLY = "ok!"


class StrictServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.bodies: list[dict] = []
        self.hits = 0  # what /metrics reports: half of every prompt after the first request
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    server: StrictServer

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "strict", "object": "model"}]})
        elif self.path == "/metrics":
            text = (
                "# TYPE vllm:prefix_cache_hits counter\n"
                f'vllm:prefix_cache_hits_total{{model_name="strict"}} {self.server.hits}\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
        else:
            self._json(404, {"detail": "Not Found"})

    def do_DELETE(self) -> None:
        self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        unknown = sorted(set(body) - KNOWN)
        if unknown:
            detail = [{"loc": ["body", k], "msg": "Extra inputs are not permitted"} for k in unknown]
            self._json(422, {"detail": detail})
            return
        prompt = len(body["prompt"]) if "prompt" in body else sum(len(m["content"]) for m in body["messages"])
        with self.server.lock:
            self.server.bodies.append(body)
            self.server.hits += prompt // 2
        if not body.get("stream"):
            self._json(200, {"choices": [{"index": 0, "text": REPLY}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = "messages" in body
        for piece in REPLY:
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        usage = {"prompt_tokens": prompt, "completion_tokens": len(REPLY), "total_tokens": prompt + 3}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def strict() -> Iterator[StrictServer]:
    server = StrictServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_replay_sends_no_extras_to_a_strict_server_and_reads_hits_from_its_metrics(strict, endpoint):
    ids = endpoint == "completions"
    first, second = (list(b"hello there"), list(b"more")) if ids else ("hello there", "more")
    turns = [Turn(first, 3), Turn(second, 3)]
    workload = Workload([Session("a", turns), Session("b", turns, arrival=0.01)])
    url = f"http://127.0.0.1:{strict.server_address[1]}/v1"
    result = replay_url(workload, Server(url, endpoint=endpoint), build_byte_tokenizer())
    sent = [b for b in strict.bodies if b.get("stream")]
    assert len(sent) == 4 and all(set(b) <= KNOWN for b in sent)
    probe_hits = len("hi") // 2  # the probe request, before the run's counters are read
    summary = summarize(result)
    assert summary["cached_tokens"] == strict.hits - probe_hits > 0
    assert summary["prompt_tokens"] == sum(r.prompt_tokens for r in result.records)
    if ids:  # the second turn's prompt holds the first reply, tokenized from its text
        second = [b["prompt"] for b in sent if len(b["prompt"]) > len(b"hello there")]
        assert all(p == list(b"hello there") + list(REPLY.encode()) + list(b"more") for p in second)


def test_extras_on_skips_the_probe_and_a_strict_server_refuses(strict):
    url = f"http://127.0.0.1:{strict.server_address[1]}/v1"
    workload = Workload([Session("a", [Turn("hello", 2)])])
    result = replay_url(workload, Server(url, endpoint="chat", extras="on"), build_byte_tokenizer())
    assert len(result.failed) == 1 and "422" in result.failed[0]  # reported, and the replay ends
    assert strict.bodies == [] and result.records == []
