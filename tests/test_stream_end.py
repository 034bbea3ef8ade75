"""Every stream, sync and async, ends with exactly one delta carrying the finish reason.

A request aborted with no token since its last delta (before its first token, or between two)
ends its stream with a closing delta: no token, no text, finish reason "abort". A stream that
ends with a token (length, a stop token, a stop string) carries the reason on that token's delta
and on no other. The oracle for the tokens is `generate` on the same engine, itself checked
against transformers in test_engine.py.
"""

from __future__ import annotations

import asyncio
import threading

from test_abort import prompt
from test_async_engine import leak_free

from radixkv import AsyncEngine, Engine, EngineConfig, SamplingParams, StreamDelta
from radixkv.chat_session import AsyncChatSession

KW = {"block_size": 4, "kv_cache_memory": "8MiB", "max_num_batched_tokens": 16}
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def abort_all_at_step(step: int):
    """A step hook that queues an abort of every request after step `step` (applied before the
    next step runs). Hooks run under the step lock, so the abort is only queued."""

    def hook(core) -> None:
        if core.num_steps == step:
            for request_id in list(core._requests):
                core.abort(request_id, wait=False)

    return hook


def assert_ends_once(deltas: list[StreamDelta], reason: str) -> None:
    """Only the last delta carries a finish reason, and it is `reason`."""
    assert deltas and deltas[-1].finish_reason == reason
    assert all(d.finish_reason is None for d in deltas[:-1])


def assert_closing(delta: StreamDelta) -> None:
    assert delta.token_id is None and delta.text == "" and delta.logprobs is None


# ---------------------------------------------------------------------------- sync Engine


def test_sync_stream_aborted_from_another_thread_ends_with_an_abort_delta(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    want = engine.generate([prompt(1, 12)], LONG)[0].token_ids
    stream = engine.stream(prompt(1, 12), LONG)
    deltas = [next(stream) for _ in range(3)]
    (request_id,) = engine._requests
    aborter = threading.Thread(target=engine.abort, args=(request_id,))
    aborter.start()
    aborter.join()
    deltas += list(stream)
    assert_ends_once(deltas, "abort")
    assert_closing(deltas[-1])
    assert [d.token_id for d in deltas[:-1]] == want[:3]
    leak_free(engine)


def test_sync_stream_aborted_before_its_first_token_yields_only_the_abort_delta(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    engine.step_hooks.append(abort_all_at_step(1))  # 40 prompt tokens at 16 a step: mid-prefill
    deltas = list(engine.stream(prompt(2, 40), LONG))
    assert len(deltas) == 1
    assert_ends_once(deltas, "abort")
    assert_closing(deltas[0])
    assert deltas[0].num_cached_tokens == 0  # the first delta of all says what the cache served
    leak_free(engine)


def test_sync_streams_that_end_with_a_token_carry_the_reason_once(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    length = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = engine.generate([prompt(3, 10)], length)[0]
    deltas = list(engine.stream(prompt(3, 10), length))
    assert_ends_once(deltas, "length")
    assert [d.token_id for d in deltas] == want.token_ids

    token = want.token_ids[2]
    stop_token = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[token])
    deltas = list(engine.stream(prompt(3, 10), stop_token))
    assert_ends_once(deltas, "stop")
    assert [d.token_id for d in deltas] == want.token_ids[: want.token_ids.index(token) + 1]

    # A stop string that starts inside held-back text: the text ends before it, and the token
    # that completes it still carries "stop" once.
    text = want.text
    stop = text[2:4]
    stopped = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop=[stop])
    expected = engine.generate([prompt(3, 10)], stopped)[0]
    assert expected.finish_reason == "stop"
    deltas = list(engine.stream(prompt(3, 10), stopped))
    assert_ends_once(deltas, "stop")
    assert all(d.token_id is not None for d in deltas)
    assert "".join(d.text for d in deltas) == expected.text
    leak_free(engine)


# ---------------------------------------------------------------------------- AsyncEngine


def test_async_streams_end_with_the_reason_once_aborted_or_not(model_folders):
    config = EngineConfig(model=str(model_folders["llama"]), **KW)
    sync = Engine(config)
    want = sync.generate([prompt(4, 12)], LONG)[0].token_ids
    length = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want_length = sync.generate([prompt(5, 12)], length)[0].token_ids

    async def main() -> None:
        engine = AsyncEngine(config, engine_process=False)  # steps hooked below
        try:
            # Aborted between two tokens by `AsyncEngine.abort`.
            deltas = []
            async for delta in engine.stream(prompt(4, 12), LONG, request_id="mid"):
                deltas.append(delta)
                if len(deltas) == 2:
                    engine.abort("mid")
            assert_ends_once(deltas, "abort")
            assert_closing(deltas[-1])
            got = [d.token_id for d in deltas[:-1]]
            assert got == want[: len(got)] and len(got) >= 2

            # Aborted before its first token: the only delta is the closing one.
            hook = abort_all_at_step(engine.core.num_steps + 1)  # the first step of its prefill
            engine.core.step_hooks.append(hook)
            deltas = [d async for d in engine.stream(prompt(6, 40), LONG)]
            engine.core.step_hooks.remove(hook)
            assert len(deltas) == 1
            assert_ends_once(deltas, "abort")
            assert_closing(deltas[0])

            # A normal finish: the last token's delta carries "length", with no closing delta.
            deltas = [d async for d in engine.stream(prompt(5, 12), length)]
            assert_ends_once(deltas, "length")
            assert [d.token_id for d in deltas] == want_length
            leak_free(engine.core)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_an_aborted_async_chat_turn_records_finish_reason_abort(model_folders, monkeypatch):
    recorded: list[tuple[list[int], str | None]] = []
    record = AsyncChatSession._record

    def spy(self, reply: list[int], finish_reason: str | None) -> None:
        recorded.append((list(reply), finish_reason))
        record(self, reply, finish_reason)

    monkeypatch.setattr(AsyncChatSession, "_record", spy)

    async def main() -> None:
        # The whole prompt in one step, so the abort after the third step comes three tokens in.
        config = EngineConfig(model=str(model_folders["llama"]), block_size=4, kv_cache_memory="8MiB")
        engine = AsyncEngine(config, engine_process=False)  # steps hooked below
        try:
            chat = engine.chat(system="You are terse.")
            hook = abort_all_at_step(engine.core.num_steps + 3)
            engine.core.step_hooks.append(hook)
            deltas = [d async for d in chat.stream("Hello there", LONG)]
            engine.core.step_hooks.remove(hook)
            assert_ends_once(deltas, "abort")
            assert_closing(deltas[-1])
            reply = [d.token_id for d in deltas[:-1]]
            assert reply and recorded == [(reply, "abort")]
            assert chat.messages[-1] == {"role": "assistant", "content": engine.decode(reply)}
            chat.close()
        finally:
            await engine.shutdown()

    asyncio.run(main())


# ---------------------------------------------------------------------------- the server's SSE


def test_an_sse_stream_aborted_by_the_engine_ends_with_an_abort_chunk(model_folders):
    """The closing delta becomes a chunk with the finish reason and no text, and counts no
    token: with logprobs every chunk lists its tokens, so `completion_tokens` is checked
    against the tokens the chunks carry."""
    import httpx
    import openai

    from radixkv.server.app import build_app

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=str(model_folders["llama"]), **KW), engine_process=False)
        app = build_app(engine, "tiny", session_idle_timeout_s=0)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://radixkv")
        client = openai.AsyncOpenAI(base_url="http://radixkv/v1", api_key="-", http_client=http)
        # 40 prompt tokens at 16 a step: the third step makes the first token. Aborted after step
        # 1 the stream has no token; after step 5, three.
        try:
            for step, made in ((1, 0), (5, 3)):
                hook = abort_all_at_step(engine.core.num_steps + step)
                engine.core.step_hooks.append(hook)
                stream = await client.completions.create(
                    model="tiny",
                    prompt=prompt(7 + step, 40),
                    max_tokens=40,
                    temperature=0,
                    logprobs=1,
                    extra_body={"ignore_eos": True},
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = [c async for c in stream]
                engine.core.step_hooks.remove(hook)
                choices = [c.choices[0] for c in chunks if c.choices]
                assert choices[-1].finish_reason == "abort"
                assert choices[-1].text == "" and choices[-1].logprobs is None
                assert all(c.finish_reason is None for c in choices[:-1])
                assert sum(len(c.logprobs.tokens) for c in choices[:-1]) == made
                assert chunks[-1].usage.completion_tokens == made
            leak_free(engine.core)
        finally:
            await http.aclose()
            await engine.shutdown()

    asyncio.run(main())
