"""`radixkv replay --url`: the replay's HTTP transport (`radixkv.tools.replay_driver`), against
any OpenAI-compatible server.

Each turn is one request on a plain HTTP/1.1 connection (the standard library's `http.client`;
the timing is the server's, not the client's, so no async client is needed), waited on in a
thread while the driver sends the others as the in-process replay does: greedy,
exactly `max_tokens` tokens (`ignore_eos`), streamed with `stream_options.include_usage`.
TTFT runs from when the turn was due to the first streamed chunk with content; prompt and cached
tokens come from `usage` (`prompt_tokens_details.cached_tokens`, 0 where a server does not say).

Prompts. `--endpoint completions` (the default for token-id workloads) sends the conversation's
token ids, built as in process (`Conversation`, the chat template through `--model`'s tokenizer
for text sessions), and reads each reply's ids back from the logprob tokens that
`return_tokens_as_token_ids` spells "token_id:N" (vLLM's extra; radixkv's server has it too),
so every prompt is the one the in-process replay would send. `--endpoint chat` (the default for
text workloads) sends messages and the replies as text, as a chat client does; the server's
template and tokenizer decide the ids.

Sessions. Every turn carries its workload session's name as the `session_id` extra, so a server
with the `session` eviction policy tells the conversations apart, and the session is closed with
`DELETE /v1/sessions/{id}` after its last turn, as the in-process replay closes it. A 404 or 405
there (a server without the route, or a session already closed by its idle timeout) is no error.

Other servers. radixkv's extras (`ignore_eos`, `session_id`, `return_tokens_as_token_ids` with
`logprobs` 0) are sent only to a server that takes them: with `extras="auto"` (the default) one
short request with them probes the server first, and a 400 or 422 there (a strict server such as
`transformers serve`) turns them off for the run ("on" and "off" skip the probe). Without them a
reply may end at EOS, and a token-id conversation reads its replies' ids by tokenizing their text
(`--model`'s tokenizer). Where `usage` carries no `cached_tokens` (vLLM without
`--enable-prompt-tokens-details`), the run's cached tokens are the change over the run of the
server's prefix-cache hit counter in `/metrics` (`CACHED_TOKEN_COUNTERS`), reported as the run's
total (`RunResult.metrics["cached_tokens"]`), since concurrent turns cannot be told apart there.

A 503 is retried after its `Retry-After`, and the wait counts in the turn's TTFT, as a user would
see it. Counters that only the server knows (preemptions, evictions, copy-on-write copies) come
from its `/metrics` when it exposes radixkv's names, as the change over the run; KV usage is not
measured from outside (0 in the report).
"""

from __future__ import annotations

import http.client
import json
import queue
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from radixkv.conversation import Conversation
from radixkv.tools.replay_driver import Ended, History, Meters, Reply, Transport, drive
from radixkv.tools.replay_result import RunResult
from radixkv.workloads.format import Session, Turn, Workload

SERVER_COUNTERS = {
    "num_preemptions": "radixkv_num_preemptions",
    "num_evicted_blocks": "radixkv_num_evicted_blocks",
    "num_cow_copies": "radixkv_num_cow_copies",
    "host_cache_hits": "radixkv_host_cache_hits",
    "store_cache_hits": "radixkv_store_cache_hits",
    "kv_store_hit_blocks": "radixkv_kv_store_hit_blocks",
    "kv_store_miss_blocks": "radixkv_kv_store_miss_blocks",
}
CACHED_TOKEN_COUNTERS = ("vllm:prefix_cache_hits", "radixkv_prefix_cache_hits")  # first found wins
EXTRAS = ("auto", "on", "off")
MAX_RETRIES_503 = 100


@dataclass(slots=True)
class Server:
    """Where to send requests: `url` may end in `/v1` or not."""

    url: str
    api_key: str | None = None
    endpoint: str | None = None  # "chat" or "completions"; None picks by workload
    model: str | None = None  # the model name to ask for; None asks /v1/models
    timeout_s: float = 600.0
    extras: str = "auto"  # radixkv's extra fields: "auto" probes the server, "on", "off"
    base_path: str = field(init=False, default="")  # the URL's path, less a trailing /v1

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be an http(s) URL, got {self.url!r}")
        if self.endpoint not in (None, "chat", "completions"):
            raise ValueError(f"--endpoint must be chat or completions, got {self.endpoint!r}")
        self.base_path = parts.path.rstrip("/").removesuffix("/v1")
        if self.extras not in EXTRAS:
            raise ValueError(f"--extras must be one of {', '.join(EXTRAS)}, got {self.extras!r}")

    def accepts_extras(self, path: str, model: str) -> bool:
        """Whether radixkv's extras are to be sent (see the module): "auto" asks `path` once
        with them, and once without if that is refused (400, 422); raises if both fail."""
        if self.extras != "auto":
            return self.extras == "on"
        body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0.0}
        if path.endswith("/chat/completions"):
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = "hi"
        extras = {"ignore_eos": True, "session_id": "radixkv-probe", "return_tokens_as_token_ids": True}
        status, answer = self._call("POST", path, {**body, **extras})
        if status == 200:
            self._call("DELETE", "/v1/sessions/" + extras["session_id"])  # whatever the answer
            return True
        if status in (400, 422):
            status, answer = self._call("POST", path, body)
            if status == 200:
                return False
        raise ValueError(f"POST {path} answered {status}: {answer[:500]!r}")

    def connect(self) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return kind(parts.hostname, parts.port, timeout=self.timeout_s)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def get(self, path: str) -> tuple[int, bytes]:
        return self._call("GET", path)

    def close_session(self, session_id: str) -> bool:
        """`DELETE /v1/sessions/{session_id}`: True if the server had the session open, False if
        it answers that it had not (404) or has no such route (404, 405); raises otherwise."""
        path = "/v1/sessions/" + urllib.parse.quote(session_id, safe="")
        status, body = self._call("DELETE", path)
        if status in (404, 405):
            return False
        if status != 200:
            raise ValueError(f"DELETE {path} answered {status}: {body[:500]!r}")
        return True

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        conn = self.connect()
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, self.base_path + path, body=payload, headers=self.headers())
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def instance(self) -> str | None:
        """The server's instance id (`GET /version`'s `instance`, new at each start); None from a
        server that does not say, or that is down."""
        try:
            status, body = self.get("/version")
            return json.loads(body).get("instance") if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None

    def healthy(self) -> bool:
        """Whether `GET /health` answers 200 now."""
        try:
            return self.get("/health")[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def served_model(self) -> str:
        if self.model is not None:
            return self.model
        status, body = self.get("/v1/models")
        if status != 200:
            raise ValueError(f"GET /v1/models answered {status}: {body[:200]!r}; pass --model")
        return json.loads(body)["data"][0]["id"]

    def counters(self) -> dict[str, float]:
        """radixkv's server counters from /metrics; {} from a server without them."""
        from prometheus_client.parser import text_string_to_metric_families

        status, body = self.get("/metrics")
        if status != 200:
            return {}
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:  # summed over labels (vLLM labels by model name)
                name = sample.name.removesuffix("_total")
                values[name] = values.get(name, 0.0) + sample.value
        found = {key: values[name] for key, name in SERVER_COUNTERS.items() if name in values}
        hits = next((values[name] for name in CACHED_TOKEN_COUNTERS if name in values), None)
        if hits is not None:
            found["cached_tokens"] = hits
        return found


@dataclass(slots=True)
class _Streamed:
    """A streamed reply as read off the wire, before its ids are settled (`_reply_ids`)."""

    first_token_s: float  # perf_counter time of the first chunk with content
    finish_s: float
    text: str
    token_ids: list[int] | None  # None when the server did not spell its tokens as ids
    prompt_tokens: int
    cached_tokens: int | None  # None when `usage` did not say
    output_tokens: int


class HttpTransport(Transport):
    """Turns as requests to `server`, each waited on in a thread of its own (a session has one
    turn in flight at a time, so at most one thread per session)."""

    def __init__(self, server: Server, tokenizer: Any, workload: Workload) -> None:
        """`workload` picks the endpoint when the server's is not set (token ids: completions)."""
        uses_ids = any(s.uses_ids for s in workload.sessions)
        self.endpoint = server.endpoint or ("completions" if uses_ids else "chat")
        if self.endpoint == "chat" and uses_ids:
            raise ValueError(
                "--endpoint chat takes text sessions; this workload has token ids: use completions"
            )
        self.server = server
        self.tokenizer = tokenizer
        self._ended: queue.SimpleQueue[tuple[int, _Streamed | None, str | None]] = queue.SimpleQueue()
        self._said = False  # whether some reply's `usage` carried cached_tokens
        self._before: dict[str, float] = {}

    def begin(self, workload: Workload) -> None:
        self.model = self.server.served_model()
        self.path = "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"
        self.extras = self.server.accepts_extras(self.path, self.model)
        self._before = self.server.counters()
        self._pool = ThreadPoolExecutor(max_workers=max(len(workload.sessions), 1))

    def history(self, session: Session) -> History:
        if self.endpoint == "completions":
            return Conversation(None if session.uses_ids else self.tokenizer, session.system)
        return Messages(session.system)

    def submit(self, key: int, session: Session, turn: Turn, prompt: Any) -> None:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": turn.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.extras:
            body.update(ignore_eos=True, session_id=session.name)
        if self.endpoint == "completions":
            body["prompt"] = prompt
            if self.extras:
                body.update(logprobs=0, return_tokens_as_token_ids=True)
        else:
            body["messages"] = prompt
        self._pool.submit(self._send, key, body)

    def _send(self, key: int, body: dict[str, Any]) -> None:
        try:
            self._ended.put((key, _send(self.server, self.path, body), None))
        except (ValueError, OSError, http.client.HTTPException) as error:
            self._ended.put((key, None, str(error)))

    def wait(self, timeout: float | None) -> list[Ended]:
        try:
            got = [self._ended.get(timeout=timeout)]
        except queue.Empty:
            return []
        while not self._ended.empty():
            got.append(self._ended.get())
        ended = []
        for key, streamed, error in got:
            if streamed is None:
                ended.append(Ended(key, None, error))
                continue
            self._said = self._said or streamed.cached_tokens is not None
            ids = _reply_ids(streamed, self.extras, self.tokenizer) if self.endpoint == "completions" else []
            reply = Reply(
                streamed.first_token_s,
                streamed.finish_s,
                streamed.text,
                ids,
                streamed.prompt_tokens,
                streamed.cached_tokens or 0,
                streamed.output_tokens,
            )
            ended.append(Ended(key, reply))
        return ended

    def close_session(self, name: str) -> None:
        self.server.close_session(name)

    def end(self) -> Meters:
        self._pool.shutdown()
        after = self.server.counters()
        before = self._before
        metrics = {key: int(after.get(key, 0) - before.get(key, 0)) for key in SERVER_COUNTERS}
        if not self._said and "cached_tokens" in after:  # `usage` never said: the server's counter does
            metrics["cached_tokens"] = int(after["cached_tokens"] - before.get("cached_tokens", 0))
        return Meters(metrics)


class Messages:
    """A chat client's history: the messages, replies as the text the server sent."""

    def __init__(self, system: str | None) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    def prompt(self, user: str) -> list[dict[str, str]]:
        self._pending = user
        return [*self.messages, {"role": "user", "content": user}]

    def add_reply(self, token_ids: list[int], text: str = "") -> None:
        self.messages += [{"role": "user", "content": self._pending}, {"role": "assistant", "content": text}]


def replay_url(
    workload: Workload, server: Server, tokenizer: Any, speed: float = 1.0, progress: bool = False
) -> RunResult:
    """Replays `workload` against `server`; returns a `RunResult`."""
    return drive(workload, HttpTransport(server, tokenizer, workload), speed, progress)


def _reply_ids(reply: _Streamed, extras: bool, tokenizer: Any) -> list[int]:
    """A completions reply's token ids: as the server spelled them, or its text tokenized."""
    if reply.token_ids is not None:
        return reply.token_ids
    if extras:
        raise ValueError("the server did not return token ids (return_tokens_as_token_ids)")
    if tokenizer is None:
        raise ValueError(
            "this server takes no return_tokens_as_token_ids: pass --model (a tokenizer) to read replies"
        )
    return tokenizer.encode(reply.text, add_special_tokens=False)


def _send(server: Server, path: str, body: dict[str, Any]) -> _Streamed:
    """One streamed request, retried after a 503's Retry-After."""
    payload = json.dumps(body).encode()
    for _ in range(MAX_RETRIES_503):
        conn = server.connect()
        try:
            conn.request("POST", server.base_path + path, body=payload, headers=server.headers())
            response = conn.getresponse()
            if response.status == 503:
                response.read()
                time.sleep(float(response.getheader("Retry-After") or 1))
                continue
            if response.status != 200:
                raise ValueError(f"POST {path} answered {response.status}: {response.read()[:500]!r}")
            return _read_stream(_events(response))
        finally:
            conn.close()
    raise ValueError(f"POST {path}: the server stayed full through {MAX_RETRIES_503} retries")


def _events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a Server-Sent Events body, up to `[DONE]`."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ValueError(f"the server failed mid-stream: {event['error']}")
        yield event


def _read_stream(events: Iterator[dict[str, Any]]) -> _Streamed:
    """A streamed reply: its text, its ids if every token came spelled "token_id:N", its usage."""
    first = None
    pieces: list[str] = []
    ids: list[int] = []
    spelled = True
    usage: dict[str, Any] = {}
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content") or ""
            tokens = (choice.get("logprobs") or {}).get("tokens") or []
            if first is None and (text or tokens):
                first = time.perf_counter()
            pieces.append(text)
            spelled = spelled and bool(tokens or not text) and all(t.startswith("token_id:") for t in tokens)
            ids += [int(t.removeprefix("token_id:")) for t in tokens if spelled]
    finish = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return _Streamed(
        first_token_s=first if first is not None else finish,
        finish_s=finish,
        text="".join(pieces),
        token_ids=ids if spelled else None,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=None if details.get("cached_tokens") is None else int(details["cached_tokens"]),
        output_tokens=int(usage.get("completion_tokens", 0)),
    )
