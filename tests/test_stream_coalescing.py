"""A front end behind the engine sends the tokens made meanwhile in one chunk, as vLLM's does.

The lag is made, not waited for: the server's event loop (the test's own, over an in-process
ASGI transport) is blocked right after the request is submitted, until the engine has made every
token and its news is queued. A stream then finds all its progress at once and must send it as
one chunk whose text, token logprobs and text offsets are the whole reply's. The oracle is the
same request answered whole; the same stream unhindered must agree with it too. Both the core in
its own process and in the server's are checked.
"""

from __future__ import annotations

import json
import threading

import pytest
from test_hostile_server import Server

TOKENS = 12
BODY = {
    "prompt": [5, 9, 2, 7, 11],
    "max_tokens": TOKENS,
    "temperature": 0.0,
    "logprobs": 2,
    "ignore_eos": True,
}


def chunks(text: str) -> list[dict]:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("engine_process", [True, False], ids=["core-process", "in-process"])
def test_a_lagging_front_end_sends_what_was_made_meanwhile_in_one_chunk(
    model_folders, monkeypatch, engine_process
):
    server = Server(model_folders["llama"], engine_process=engine_process)
    stream = {**BODY, "stream": True}
    try:
        whole = server.run(server.http.post("/v1/completions", json=BODY)).json()["choices"][0]
        unhindered = chunks(server.run(server.http.post("/v1/completions", json=stream)).text)

        submit, post_all, posted_end = server.engine.core.submit, server.engine._post_all, threading.Event()

        def post_all_noting_the_end(posts):
            post_all(posts)
            if any(getattr(item, "finished", False) for _, item in posts):
                posted_end.set()  # the stream's last news is in its queue

        def submit_then_lag(requests, *args, **kwargs):
            ids = submit(requests, *args, **kwargs)
            # This blocks the server's event loop: the engine runs on, nobody reads its news.
            assert posted_end.wait(120), "the engine did not finish the request within 120 s"
            return ids

        monkeypatch.setattr(server.engine, "_post_all", post_all_noting_the_end)
        monkeypatch.setattr(server.engine.core, "submit", submit_then_lag)
        lagged = chunks(server.run(server.http.post("/v1/completions", json=stream)).text)
    finally:
        server.close()

    assert len(lagged) == 1  # everything at once (a front end that keeps up sends a chunk a token)
    for stream in (unhindered, lagged):
        choices = [c["choices"][0] for c in stream]
        assert "".join(c["text"] for c in choices) == whole["text"]
        assert choices[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
        got = {key: [v for c in choices for v in c["logprobs"][key]] for key in whole["logprobs"]}
        assert got["tokens"] == whole["logprobs"]["tokens"]
        assert got["text_offset"] == whole["logprobs"]["text_offset"]
        # The runs batch differently (and later ones hit the prefix cache): logprobs agree within
        # the bound derived in test_stop_and_logprobs (two log-softmaxes, each within 2 x 2e-4).
        assert got["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"], abs=8e-4)
        for top, want in zip(got["top_logprobs"], whole["logprobs"]["top_logprobs"], strict=True):
            assert top.keys() == want.keys()
            assert list(top.values()) == pytest.approx(list(want.values()), abs=8e-4)
