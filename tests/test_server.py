"""`radixkv serve` over real HTTP on a loopback port, checked with the official `openai` client.

One server process serves the module (a tiny seeded Llama from `model_folders`); the oracle is
an in-process `Engine` on the same weights, and transformers itself for logprobs. The overload
and SIGTERM checks start a second, deliberately small server of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from radixkv import BeamSearchParams, Engine, EngineConfig, SamplingParams
from radixkv.cli import main
from radixkv.interpreter import python_argv
from radixkv.tools.replay_http import Server
from radixkv.workloads.format import Session, Turn, write_workload

KEY = "test-key"
BLOCK = 4
KV = "8MiB"
SYSTEM = "You are a terse assistant."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(
    folder: Path, log: Path, *extra: str, check_exit: bool = True
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A `radixkv serve` process on a free port; yields its URL once /health answers, and on exit
    sends SIGTERM and (with `check_exit`) checks that it exits 0."""
    port = free_port()
    argv = python_argv("-m", "radixkv.cli", "serve", "--model", str(folder), "--port", str(port))
    argv += ["--block-size", str(BLOCK), "--kv-cache-memory", KV, *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        assert rc == 0 or not check_exit, log.read_text()


@pytest.fixture(scope="module")
def server(model_folders, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with serve(model_folders["llama"], log, "--api-key", KEY, "--served-model-name", "tiny") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine(model_folders) -> Engine:
    """The oracle: an in-process engine on the server's weights and block size."""
    return Engine(EngineConfig(model=str(model_folders["llama"]), block_size=BLOCK, kv_cache_memory=KV))


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def post(url: str, path: str, body, key: str | None = KEY, timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout)


# ------------------------------------------------------------------ outputs against the engine


def test_completions_greedy_equal_the_engine(client, engine):
    prompts = ["The quick brown fox", "Once upon a time", "def main():"]
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    want = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.finish_reason for c in got.choices] == [w.finish_reason for w in want]
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    ids = [5, 80, 120, 33, 7]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert (
        by_ids.choices[0].text == engine.generate([ids], SamplingParams(max_tokens=6, temperature=0))[0].text
    )


def test_chat_greedy_equals_the_engine_streamed_or_not(client, engine):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    want = engine.generate([chat_ids(engine, messages)], SamplingParams(max_tokens=10, temperature=0))[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_completion_matches_and_reports_cached_tokens(client, engine):
    prompt = "A streamed completion, twice over"
    want = engine.generate([prompt], SamplingParams(max_tokens=9, temperature=0))[0]
    for _ in range(2):  # the second finds the first's prompt in the cache
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=9,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(want.prompt_token_ids)
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - BLOCK


def test_seeded_samples_are_reproducible_streamed_or_not(client):
    kwargs = {
        "model": "tiny",
        "prompt": "Random words:",
        "max_tokens": 8,
        "temperature": 1.0,
        "n": 3,
        "seed": 7,
    }
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # three samples, not one three times
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(3)] == texts


def test_beam_search_equals_the_engine(client, engine):
    prompt = "Beams over the sea"
    got = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        n=3,
        temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": 1.0, "early_stopping": True},
    )
    want = engine.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6, early_stopping=True))
    assert [c.text for c in got.choices] == [b.text for b in want]
    assert got.usage.completion_tokens == sum(len(b.token_ids) for b in want)


def test_stop_strings_end_the_text_before_them(client, engine):
    prompt = "Stop me if you can"
    full = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    printable = [i for i in range(2, len(full) - 2) if full[i : i + 2].isprintable()]
    assert printable, full
    stop = full[printable[0] : printable[0] + 2]
    got = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_logprobs_match_transformers(client, engine, reference_models):
    prompt = "Log probabilities"
    got = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
    )
    lp = got.choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        logits = reference_models["llama"](torch.tensor([prompt_ids + ids])).logits[0]
    ref = torch.log_softmax(logits.double(), dim=-1)[len(prompt_ids) - 1 : -1]
    for k, token in enumerate(ids):
        assert lp.token_logprobs[k] == pytest.approx(ref[k, token].item(), abs=1e-3)
        top = {int(t.removeprefix("token_id:")) for t in lp.top_logprobs[k]}
        assert top == set(ref[k].topk(3).indices.tolist())
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)


# ----------------------------------------------------------------------------- the cache


def test_multi_turn_chat_finds_the_reply_even_when_its_text_does_not_round_trip(client, engine):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me something odd."}]
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=24,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    reply = first.choices[0].message.content
    reply_ids = [int(e.token.removeprefix("token_id:")) for e in first.choices[0].logprobs.content]
    # The precondition that makes the splice necessary: the text's own tokens are other ids.
    assert engine.tokenizer.encode(reply, add_special_tokens=False) != reply_ids
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    turn1 = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= turn1 - BLOCK


def test_a_client_that_disconnects_mid_stream_frees_its_request(server):
    # A long context makes each step slow (~0.1 s here), so the request would run for ~40 s.
    prompt = [random.Random(5).randrange(256) for _ in range(1600)]
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept open: dropping the iterator would close the connection
        assert next(line for line in lines if line.startswith("data:"))
        assert metric(server, "radixkv_running") == 1
    wait_until_idle(server)
    # Not streamed: the client gives up waiting, and the server aborts the request.
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", {**body, "stream": False}, timeout=1.0)
    wait_until_idle(server)


def wait_until_idle(url: str, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while metric(url, "radixkv_running") + metric(url, "radixkv_waiting") != 0:
        assert time.monotonic() < deadline, "the request still runs after its client left"
        time.sleep(0.05)


def test_64_concurrent_clients_are_all_answered_correctly(server, engine):
    rng = random.Random(1)
    prompts = ["".join(rng.choice("abcdefghij ") for _ in range(rng.randrange(4, 30))) for _ in range(64)]
    want = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0))

    async def ask_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0) as aclient:
            outs = await asyncio.gather(
                *[
                    aclient.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
                    for p in prompts
                ]
            )
        return [o.choices[0].text for o in outs]

    assert asyncio.run(ask_all()) == [w.text for w in want]


# ------------------------------------------------------------------------ the HTTP surface

BAD_COMPLETIONS = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [100000]}, "prompt"),
    ({"prompt": [1] * 5000}, "prompt"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"n": 200}, "n"),  # above --max-num-seqs
    ({"n": 200, "stream": True}, "n"),
    ({"n": 100, "max_tokens": 2000}, "max_tokens"),  # more KV than the pool holds
    ({"seed": 1.5}, "seed"),
    ({"stop": [1]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stream": 1}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"echo": True, "stream": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"logit_bias": {"x": 2.0}}, "logit_bias"),
    ({"logit_bias": {"1": 200}}, "logit_bias"),
    ({"logit_bias": {"100000": 2.0}}, "logit_bias"),
    ({"use_beam_search": True, "logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"use_beam_search": True, "echo": True, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "n": 0}, "n"),
    ({"use_beam_search": True, "n": 200}, "n"),
    ({"use_beam_search": True, "stop": ["a"]}, "stop"),
    ({"use_beam_search": True, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "stream": True}, "stream"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
    ({"length_penalty": "x", "use_beam_search": True}, "length_penalty"),
    ({"early_stopping": "sometimes", "use_beam_search": True}, "early_stopping"),
]
BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"logprobs": 2}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        *[("/v1/completions", {"prompt": "hi", **b}, p) for b, p in BAD_COMPLETIONS],
        *[
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **b}, p)
            for b, p in BAD_CHAT
        ],
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(server, path, body, param):
    response = post(server, path, {"model": "tiny", "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_malformed_bodies_unknown_models_and_keys(server):
    for body in ("{not json", "[1, 2]", '"text"'):
        response = post(server, "/v1/completions", body)
        assert response.status_code == 400 and response.json()["error"]["message"], body
    response = post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    for key in (None, "wrong"):
        response = post(server, "/v1/completions", {"prompt": "hi"}, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models").status_code == 401
    models = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(f"{server}/health").status_code == 200  # probes need no key
    assert post(server, "/v1/nothing", {}).json()["error"]["message"]


def test_metrics_parse_as_prometheus_text(server):
    text = httpx.get(f"{server}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["radixkv_time_to_first_token_seconds"].type == "histogram"
    assert families["radixkv_e2e_request_latency_seconds"].type == "histogram"
    assert families["radixkv_prefix_cache_hits"].type == "counter"
    assert families["radixkv_kv_cache_usage"].type == "gauge"
    ttft = {
        s.name: s.value
        for s in families["radixkv_time_to_first_token_seconds"].samples
        if "le" not in s.labels
    }
    assert ttft["radixkv_time_to_first_token_seconds_count"] > 0
    buckets = [
        s for s in families["radixkv_time_to_first_token_seconds"].samples if s.labels.get("le") == "+Inf"
    ]
    assert buckets[0].value == ttft["radixkv_time_to_first_token_seconds_count"]


# ---------------------------------------------------------------------------- replay --url


def replay_both(
    workload: Path, model_folder: Path, url: str, tmp_path: Path, *url_args: str
) -> tuple[dict, dict]:
    """The workload replayed in process and against `url` through the command line: each RUN."""
    runs = []
    for name, extra in (
        ("local", ["--model", str(model_folder), "--kv-cache-memory", KV]),
        ("url", ["--url", f"{url}/v1", "--api-key", KEY, *url_args]),
    ):
        path = tmp_path / f"{name}.json"
        argv = [
            "replay",
            str(workload),
            "--block-size",
            str(BLOCK),
            "--speed",
            "4",
            "--json",
            "--report",
            str(path),
        ]
        assert main([*argv, *extra]) == 0
        runs.append(json.loads(path.read_text())["runs"]["prefix_cache"])
    return runs[0], runs[1]


def test_replay_against_the_server_finds_what_the_engine_finds(server, model_folders, tmp_path, monkeypatch):
    rng = random.Random(3)
    system = [rng.randrange(128, 256) for _ in range(30)]  # no other test's prompt starts like this
    sessions = [
        Session(
            f"s{i}", [Turn([rng.randrange(128, 256) for _ in range(6)], 4) for _ in range(3)], 2.0 * i, system
        )
        for i in range(2)
    ]
    workload = tmp_path / "w.jsonl"
    write_workload(workload, sessions, {"generator": "test"})
    closes = []
    close = Server.close_session

    def recorded_close(self: Server, session_id: str) -> bool:
        closes.append((session_id, close(self, session_id)))
        return closes[-1][1]

    monkeypatch.setattr(Server, "close_session", recorded_close)
    local, url = replay_both(workload, model_folders["llama"], server, tmp_path)
    # Each session's turns carried its id: the server had it open until the replay closed it.
    assert sorted(closes) == [("s0", True), ("s1", True)]
    assert Server(f"{server}/v1", KEY).close_session("s0") is False  # the replay closed it
    assert url["requests"] == local["requests"] == 6
    assert url["prompt_tokens"] == local["prompt_tokens"]
    assert url["output_tokens"] == local["output_tokens"]
    assert url["cached_tokens"] == local["cached_tokens"] > 0
    assert url["hit_rate"] == local["hit_rate"]


def test_replay_closing_a_session_the_server_does_not_hold_is_no_error_but_a_refusal_is(server):
    assert Server(f"{server}/v1", KEY).close_session("never-opened") is False
    with pytest.raises(ValueError, match="answered 401"):
        Server(f"{server}/v1", "wrong-key").close_session("never-opened")


def test_replay_over_chat_sends_the_prompts_the_engine_would(server, model_folders, tmp_path):
    """Text sessions through /v1/chat/completions: the replies go back as text, and the server's
    splicing makes every prompt the one the in-process replay builds from the generated ids (a
    reply whose text does not survive a decode and encode would otherwise change its length)."""
    sessions = [
        Session(
            f"t{i}",
            [Turn(f"Question {k} of session {i}?", 8) for k in range(2)],
            2.0 * i,
            "Replay over chat.",
        )
        for i in range(2)
    ]
    workload = tmp_path / "chat.jsonl"
    write_workload(workload, sessions, {"generator": "test"})
    local, url = replay_both(workload, model_folders["llama"], server, tmp_path, "--endpoint", "chat")
    assert url["requests"] == local["requests"] == 4
    assert url["prompt_tokens"] == local["prompt_tokens"]
    # At least what the engine found; the shared server may also hold other tests' template heads.
    assert url["cached_tokens"] >= local["cached_tokens"] > 0


# ------------------------------------------------------------------ overload and SIGTERM


def test_overload_is_a_503_and_loses_nothing_accepted(model_folders, engine):
    """The engine is held (its step lock taken) while ten requests arrive, so exactly the two that
    `--max-waiting 2` lets wait are admitted, whatever the machine's speed; the rest get 503."""
    from radixkv import AsyncEngine
    from radixkv.server.app import build_app

    prompts = [f"request number {i}" for i in range(10)]
    want = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))

    async def burst() -> list[httpx.Response]:
        config = EngineConfig(model=str(model_folders["llama"]), block_size=BLOCK, kv_cache_memory=KV)
        served = AsyncEngine(config, engine_process=False)  # holds the step lock below
        app = build_app(served, "tiny", max_waiting=2, session_idle_timeout_s=0)
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
            with served.core._lock:  # no step runs: admitted requests wait
                tasks = [
                    asyncio.ensure_future(http.post("/v1/completions", json={"prompt": p, **body}))
                    for p in prompts
                ]
                while sum(t.done() for t in tasks) < 8:
                    await asyncio.sleep(0.01)
            responses = await asyncio.gather(*tasks)
        await served.shutdown()
        return responses

    responses = asyncio.run(asyncio.wait_for(burst(), timeout=120))
    assert [r.status_code for r in responses].count(503) == 8
    for response, w in zip(responses, want, strict=True):
        if response.status_code == 503:
            assert response.headers["Retry-After"] and response.json()["error"]["code"] == "overloaded"
        else:
            assert response.json()["choices"][0]["text"] == w.text
            assert response.json()["usage"]["completion_tokens"] == 12


@pytest.mark.slow
def test_sigterm_ends_every_stream_and_exits_cleanly(model_folders, tmp_path):
    extra = ["--max-num-seqs", "2", "--graceful-timeout", "5"]
    with serve(model_folders["llama"], tmp_path / "serve.log", *extra) as (url, proc):
        short, cut = asyncio.run(sigterm_during(url, proc))
        assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in short[-2]  # finished in grace
        # Still going when the grace period ended: aborted, and ended as a stream ends.
        assert cut[-1] == "data: [DONE]" and '"finish_reason":"abort"' in cut[-2]
        assert proc.wait(timeout=30) == 0
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log


async def sigterm_during(url: str, proc: subprocess.Popen) -> tuple[list[str], list[str]]:
    """A stream far longer than the 5 s grace period runs; a short one starts beside it; SIGTERM
    comes once both have their first token. New connections are refused from then on. Returns
    each stream's SSE lines."""
    long_prompt = [random.Random(6).randrange(256) for _ in range(1600)]  # ~0.1 s a step: ~40 s

    async def read(http: httpx.AsyncClient, prompt, max_tokens: int, started: asyncio.Event) -> list[str]:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        lines: list[str] = []
        with contextlib.suppress(httpx.HTTPError):  # the cut stream ends without its last chunk
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        started.set()
        return lines

    async with httpx.AsyncClient(timeout=60) as http:
        streams = []
        for prompt, max_tokens in ((long_prompt, 400), ("short", 8)):
            started = asyncio.Event()
            streams.append(asyncio.ensure_future(read(http, prompt, max_tokens, started)))
            await started.wait()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:  # new connections are refused once the server has taken the signal
            try:
                await http.get(f"{url}/health")
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                # Refused; or accepted as the listening socket closed, then dropped or reset before
                # its answer (both seen with both cores busy).
                break
            assert time.monotonic() < deadline, "the server still accepts connections after SIGTERM"
            await asyncio.sleep(0.05)
        cut, short = await asyncio.gather(*streams)
    return short, cut
