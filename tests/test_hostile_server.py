"""Hostile traffic against the server, from outside (raw HTTP and the official `openai` client,
over an in-process ASGI transport): bodies too large, clients that leave mid-upload, errors that
must not leak, a dead engine, tenants probing each other's prompts through `cached_tokens`, and
a tokenizer used by many threads at once."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import openai
import pytest

from radixkv import AsyncEngine, EngineConfig
from radixkv.server import engine_inputs, handlers
from radixkv.server.app import build_app

KW = {"block_size": 4, "kv_cache_memory": "8MiB", "max_num_batched_tokens": 64, "max_num_seqs": 8}
LIMIT = 64 * 1024


class Server:
    """An app over a fresh engine (its core in its own process unless `engine_process` is
    False), driven from a private event loop."""

    def __init__(self, folder, engine_process: bool = True, **app_kw) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = AsyncEngine(EngineConfig(model=str(folder), **KW), engine_process=engine_process)
        app_kw.setdefault("session_idle_timeout_s", 0)
        self.app = build_app(self.engine, "tiny", **app_kw)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://radixkv")

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def client(self, key: str = "-") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://radixkv/v1", api_key=key, http_client=self.http)

    def close(self) -> None:
        self.run(self.http.aclose())
        self.run(self.engine.shutdown())
        self.loop.close()


@pytest.fixture
def server(model_folders):
    s = Server(model_folders["llama"], max_request_bytes=LIMIT)
    yield s
    s.close()


@pytest.fixture
def in_process_server(model_folders):
    """For tests that break the in-process loop from inside (a core process: test_engine_process)."""
    s = Server(model_folders["llama"], engine_process=False, max_request_bytes=LIMIT)
    yield s
    s.close()


# ----------------------------------------------------------------------- ids and errors


def test_every_response_carries_a_request_id_the_clients_own_when_it_sent_one(server):
    async def main():
        ok = await server.http.get("/health", headers={"x-request-id": "trace-42"})
        fresh = await server.http.get("/v1/models")
        bad = await server.http.post("/v1/completions", json={"prompt": [1, 2], "n": 0})
        missing = await server.http.get("/v1/nothing")
        wrong_method = await server.http.get("/v1/completions")
        return ok, fresh, bad, missing, wrong_method

    ok, fresh, bad, missing, wrong_method = server.run(main())
    assert ok.headers["x-request-id"] == "trace-42"
    ids = {r.headers["x-request-id"] for r in (fresh, bad, missing, wrong_method)}
    assert len(ids) == 4 and all(len(i) == 32 for i in ids)
    assert (bad.status_code, missing.status_code, wrong_method.status_code) == (400, 404, 405)
    assert wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


def test_an_unexpected_error_is_logged_under_the_request_id_and_never_sent(server, monkeypatch, caplog):
    async def broken(*args, **kwargs):
        raise RuntimeError("PIN=739214 leaked from another request")

    monkeypatch.setattr(handlers, "create", broken)
    with caplog.at_level(logging.ERROR, logger="radixkv.server"):
        response = server.run(
            server.http.post("/v1/completions", json={"prompt": [1, 2]}, headers={"x-request-id": "r-7"})
        )
    assert response.status_code == 500 and response.headers["x-request-id"] == "r-7"
    error = response.json()["error"]
    assert "739214" not in response.text and "r-7" in error["message"] and error["code"] == "RuntimeError"
    logged = [r for r in caplog.records if "r-7" in r.getMessage()]
    assert len(logged) == 1 and "739214" in str(logged[0].exc_info[1])


# ---------------------------------------------------------------------------- big bodies


def test_a_body_over_the_limit_is_a_413_from_its_length_alone(server):
    sent = []

    async def trickle():
        yield b'{"prompt": "'
        sent.append(1)
        yield b"x" * (LIMIT + 1)
        sent.append(2)
        yield b'"}'

    async def main():
        declared = await server.http.post(
            "/v1/completions", content=trickle(), headers={"content-length": str(LIMIT + 20)}
        )
        streamed = await server.http.post("/v1/completions", content=trickle())  # chunked: no length
        return declared, streamed

    declared, streamed = server.run(main())
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "too_large"
    assert streamed.status_code == 413
    assert sent.count(2) <= 1, "the declared-length upload was read past the limit"


def test_health_answers_while_large_bodies_are_refused_and_long_prompts_are_tokenized(server):
    async def main():
        big = [server.http.post("/v1/completions", content=b"x" * (LIMIT + 1)) for _ in range(4)]
        long_prompt = server.http.post(
            "/v1/completions", json={"prompt": "ab" * 3000, "max_tokens": 1}
        )  # under the limit: tokenized in a worker thread, then refused by the engine (too long)
        health = [server.http.get("/health") for _ in range(8)]
        return await asyncio.gather(*big, long_prompt, *health)

    replies = server.run(main())
    assert [r.status_code for r in replies[:4]] == [413] * 4
    assert replies[4].status_code == 400 and replies[4].json()["error"]["param"] == "prompt"
    assert all(r.status_code == 200 for r in replies[5:])


def test_prompt_text_that_cannot_fit_is_refused_before_tokenizing(server, monkeypatch):
    limit = server.app.state.radixkv.max_prompt_chars
    calls = []
    real = engine_inputs._prompt_ids
    monkeypatch.setattr(engine_inputs, "_prompt_ids", lambda *a: calls.append(1) or real(*a))
    small = Server.__new__(Server)  # the fixture's limit of 64 KiB bodies is below the text size
    small.loop, small.engine = server.loop, server.engine
    small.app = build_app(server.engine, "tiny", max_request_bytes=4 * limit, session_idle_timeout_s=0)
    small.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=small.app), base_url="http://radixkv")
    reply = server.run(small.http.post("/v1/completions", json={"prompt": "a" * (limit + 1)}))
    server.run(small.http.aclose())
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert not calls, "the text was tokenized"


def test_a_client_gone_mid_upload_is_one_info_line(server, caplog):
    messages = [
        {"type": "http.request", "body": b'{"prompt": [1, ', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"",
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "server": ("radixkv", 80),
        "client": ("127.0.0.1", 1),
        "headers": [(b"content-type", b"application/json")],
    }
    with caplog.at_level(logging.INFO):
        server.run(server.app(scope, receive, send))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert len([r for r in caplog.records if "during the upload" in r.getMessage()]) == 1


# --------------------------------------------------------------------------- dead engine


def test_when_the_engine_loop_dies_every_request_fails_at_once_and_health_is_503(in_process_server):
    server = in_process_server
    core = server.engine.core

    def broken() -> bool:
        raise SystemError("a bug outside any step")

    async def main():
        assert (await server.http.get("/health")).status_code == 200
        core.has_work = broken
        pending = await server.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        later = await server.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        stream = await server.http.post(
            "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
        )
        return pending, later, stream, await server.http.get("/health")

    pending, later, stream, health = server.run(asyncio.wait_for(main(), timeout=60))
    assert pending.status_code == 500 and pending.json()["error"]["code"] == "engine_step_failed"
    assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
    assert stream.status_code == 503
    assert health.status_code == 503


def test_a_request_opened_just_after_the_loop_died_fails_instead_of_waiting(in_process_server):
    """The race: the loop dies after a caller's liveness check but before the loop's last look
    at the registered requests. Emulated by dying inside the submission."""
    from radixkv import RequestError, SamplingParams

    server = in_process_server
    engine = server.engine
    real_submit = engine.core.submit

    def submit_then_die(requests):
        ids = real_submit(requests)
        engine._fatal = SystemError("died")
        return ids

    async def open_one():
        request = engine.core.make_request([1, 2, 3], SamplingParams(max_tokens=2), call="generate")
        return await asyncio.wait_for(engine._open(request).queue.get(), 5)

    engine.core.submit = submit_then_die
    try:
        item = server.run(open_one())
    finally:
        engine._fatal = None
        engine.core.submit = real_submit
    assert isinstance(item, RequestError)


# ------------------------------------------------------------------------------ tenants

SECRET = "PIN=739; the vault opens at noon"


async def probe_pin(client: openai.AsyncOpenAI, salt: str | None, digits: int = 3) -> str:
    """The attack: guess the PIN digit by digit, keeping the guess whose prompt was cached most."""
    known = ""
    for _ in range(digits):
        scores = {}
        for d in "0123456789":
            extra = {"cache_salt": salt} if salt else {}
            reply = await client.completions.create(
                model="tiny", prompt=f"PIN={known}{d}#", max_tokens=1, temperature=0, extra_body=extra
            )
            scores[d] = reply.usage.prompt_tokens_details.cached_tokens
        best = max(scores.values())
        winners = [d for d, s in scores.items() if s == best]
        if len(winners) != 1:
            return known  # no signal: the secret is not readable from here
        known += winners[0]
    return known


def plant_secret(server: Server, key: str = "-", salt: str | None = None) -> None:
    extra = {"cache_salt": salt} if salt else {}
    client = server.client(key)
    server.run(client.completions.create(model="tiny", prompt=SECRET, max_tokens=1, extra_body=extra))


def test_the_pin_probe_reads_a_secret_in_a_shared_cache_and_nothing_across_salts(server):
    plant_secret(server, salt="tenant-a")
    assert server.run(probe_pin(server.client(), "tenant-a")) == "739"  # the attack is real
    assert server.run(probe_pin(server.client(), "tenant-b")) == ""
    assert server.run(probe_pin(server.client(), None)) == ""


def test_per_key_isolation_keeps_each_keys_prompts_to_itself(model_folders):
    s = Server(model_folders["llama"], api_key=["key-a", "key-b"], cache_isolation="per-key")
    try:
        plant_secret(s, key="key-a")
        assert s.run(probe_pin(s.client("key-b"), None)) == ""
        assert s.run(probe_pin(s.client("key-b"), "anything")) == ""
        again = s.run(s.client("key-a").completions.create(model="tiny", prompt=SECRET, max_tokens=1))
        assert again.usage.prompt_tokens_details.cached_tokens == len(SECRET) - 1  # its own: all but the last
    finally:
        s.close()


def test_tokenize_counts_a_chat_as_the_chat_endpoint_builds_it_for_the_same_key(model_folders):
    """Under per-key isolation a known reply is spliced back as its generated ids only for its own
    key: /tokenize builds the same prompt the chat endpoint runs for that key."""
    s = Server(model_folders["llama"], api_key=["key-a", "key-b"], cache_isolation="per-key")
    try:
        a = s.client("key-a")
        first = [{"role": "user", "content": "tell me"}]
        reply = s.run(a.chat.completions.create(model="tiny", messages=first, max_tokens=8, temperature=0))
        said = reply.choices[0].message.content
        convo = [*first, {"role": "assistant", "content": said}, {"role": "user", "content": "more"}]
        again = s.run(a.chat.completions.create(model="tiny", messages=convo, max_tokens=1))
        counted = s.run(
            s.http.post("/tokenize", json={"messages": convo}, headers={"authorization": "Bearer key-a"})
        )
        assert counted.json()["count"] == again.usage.prompt_tokens
    finally:
        s.close()


def test_cached_tokens_count_only_the_salts_own_blocks(server):
    prompt = list(range(10, 50))

    async def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        client = server.client()
        reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    async def main():
        return [await cached(s) for s in ("a", "b", "a", None, "b")]

    assert server.run(main()) == [0, 0, len(prompt) - 1, 0, len(prompt) - 1]


def test_api_keys_must_be_printable_ascii_and_may_come_from_a_file(tmp_path):
    import argparse

    from radixkv.server.launch import read_api_keys

    with pytest.raises(ValueError, match="ASCII"):
        build_app(object(), "tiny", api_key="ключ")
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nalpha\n\n  beta  \n")
    args = argparse.Namespace(api_key=["gamma"], api_key_file=str(keys))
    assert read_api_keys(args) == ("gamma", "alpha", "beta")
    with pytest.raises(ValueError, match="ASCII"):
        read_api_keys(argparse.Namespace(api_key=["naïve"], api_key_file=None))


# ---------------------------------------------------------------------------- tokenizers


def test_one_tokenizer_serves_many_threads_at_once(server):
    tokenizer = server.engine.tokenizer
    texts = [f"thread {i}: " + "héllo wörld " * (50 + i) for i in range(8)]
    expected = [tokenizer.own().encode(t, add_special_tokens=False) for t in texts]
    errors, copies = [], set()
    barrier = threading.Barrier(len(texts))

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(50):
                ids = tokenizer.encode(texts[i], add_special_tokens=False)
                assert ids == expected[i] and tokenizer.decode(ids) == texts[i]
            copies.add(id(tokenizer.own()))
        except Exception as error:  # reported below, with the thread's index
            errors.append((i, error))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(copies) == len(texts)


def test_remembered_replies_are_kept_apart_by_cache_namespace():
    from radixkv.model.tokenizer import build_byte_tokenizer
    from radixkv.server.chat_prompt import ReplyStore

    replies = ReplyStore(build_byte_tokenizer())
    replies.add("the reply", list(b"the reply"), namespace="tenant-a")
    assert replies.get("the reply", "tenant-a") == list(b"the reply")
    assert replies.get("the reply", "tenant-b") is None and replies.get("the reply") is None


def test_the_tokenizer_routes_tokenize_and_decode_off_the_event_loop(server, monkeypatch):
    """The event loop runs in this thread (`Server.run`): no tokenizer copy is asked for here while
    `/tokenize` and `/detokenize` work, so their text is never encoded or decoded on the loop."""
    from radixkv.model.tokenizer_threads import PerThreadTokenizer

    threads = []
    real_own = PerThreadTokenizer.own

    def own(self):
        threads.append(threading.get_ident())
        return real_own(self)

    monkeypatch.setattr(PerThreadTokenizer, "own", own)

    async def main():
        text = await server.http.post("/tokenize", json={"prompt": "ab" * 2000})
        chat = await server.http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        back = await server.http.post("/detokenize", json={"tokens": text.json()["tokens"][:8]})
        return text, chat, back

    text, chat, back = server.run(main())
    calls = len(threads)  # the checks below decode here
    assert (text.status_code, chat.status_code, back.status_code) == (200, 200, 200)
    assert text.json()["count"] == len(text.json()["tokens"]) > 0
    assert "".join(server.engine.tokenizer.decode([t]) for t in text.json()["tokens"]) == "ab" * 2000
    assert back.json()["prompt"] == server.engine.tokenizer.decode(text.json()["tokens"][:8])
    assert threads and threading.get_ident() not in threads[:calls]
