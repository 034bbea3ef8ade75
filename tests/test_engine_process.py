"""The engine core in its own process (`radixkv.engine.process`): what the front end gets from it
equals the in-process engine's, a failed step fails only its requests, control calls reach the
core, and a dead core is a clean error at once, in `AsyncEngine` and in `radixkv serve`.

The oracle is the in-process `Engine` on the same weights (itself checked against transformers
in test_engine.py). Every wait has a deadline that fails the test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time

import httpx
import msgspec
import pytest
import zmq
from core_faults import POISON, forbid_decoding
from processes import children, exited
from test_server import serve

from radixkv import AsyncEngine, BeamSearchParams, Engine, EngineConfig, RequestError, SamplingParams
from radixkv.engine.process.messages import (
    Done,
    Fatal,
    RequestUpdate,
    SeqUpdate,
    StepOutput,
    pack_ids,
    unpack_ids,
)
from radixkv.errors import EngineDeadError, InvariantError
from radixkv.scheduler.request import Status

KW = {"block_size": 4, "kv_cache_memory": "8MiB"}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
SERVE = ("--graceful-timeout", "2")


def launcher_and_core(server_pid: int) -> tuple[int, int]:
    """The server's one child, the launcher that forks cores, and the core it forked."""
    (launcher,) = children(server_pid)
    (core,) = children(launcher)
    return launcher, core


def wait_for(done, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


def test_messages_round_trip_token_ids_as_bytes():
    ids = [0, 1, 255, 2**31 - 1]
    update = RequestUpdate("r", [SeqUpdate(0, pack_ids(ids), None, "stop", -1.5)], num_cached_tokens=3)
    data = msgspec.msgpack.encode(StepOutput([update], 1, 7))
    back = msgspec.msgpack.decode(data, type=StepOutput)
    assert list(unpack_ids(back.updates[0].seqs[0].tokens)) == ids
    assert back.updates[0].seqs[0].finish_reason == "stop" and back.num_steps == 7
    assert len(data) < 64  # positional structs: no field names on the wire


def test_outputs_equal_the_in_process_engine(model_folders):
    config = EngineConfig(model=str(model_folders["llama"]), **KW)
    sync = Engine(config)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [1, 2, 3, 4, 6, 7]]
    want = sync.generate(prompts, GREEDY)
    sampled = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3, logprobs=2, prompt_logprobs=1)
    want_n = sync.generate([[5, 6, 7]], sampled)[0]
    beam = BeamSearchParams(beam_width=3, max_tokens=5)
    want_beams = sync.beam_search([4, 4, 2], beam)
    stop = SamplingParams(max_tokens=30, temperature=0.0, stop=[sync.decode(want[0].token_ids[2:4])])
    want_stop = sync.generate([prompts[0]], stop)[0]

    async def main() -> None:
        engine = AsyncEngine(config)
        try:
            assert engine.engine_process and engine.core.process.poll() is None
            outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
            assert [o.token_ids for o in outs] == [w.token_ids for w in want]
            assert [o.text for o in outs] == [w.text for w in want]
            deltas = [d async for d in engine.stream(prompts[2], GREEDY)]
            assert [d.token_id for d in deltas] == want[2].token_ids
            assert deltas[0].num_cached_tokens >= 4  # the prefix of prompt 0, cached in the core
            assert deltas[-1].finish_reason == "length"
            n = await engine.generate([5, 6, 7], sampled)
            assert [s.token_ids for s in n.samples] == [s.token_ids for s in want_n.samples]
            assert [s.logprobs for s in n.samples] == [s.logprobs for s in want_n.samples]
            assert n.prompt_logprobs == want_n.prompt_logprobs
            beams = await engine.beam_search([4, 4, 2], beam)
            assert [(b.token_ids, b.text, b.finish_reason) for b in beams] == [
                (b.token_ids, b.text, b.finish_reason) for b in want_beams
            ]
            assert [b.score for b in beams] == pytest.approx([b.score for b in want_beams])
            stopped = await engine.generate(prompts[0], stop)
            assert (stopped.token_ids, stopped.text, stopped.finish_reason) == (
                want_stop.token_ids,
                want_stop.text,
                "stop",
            )
            chat = engine.chat(system=[1, 2, 3])
            first = await chat.send([4, 5, 6], GREEDY)
            second = await chat.send([7, 8], GREEDY)
            assert second.num_cached_tokens >= len(first.prompt_token_ids)
            chat.close()  # a session close, queued to the core
            metrics = engine.metrics()
            assert metrics["num_blocks"] == sync.metrics()["num_blocks"]
            assert metrics["prefix_cache_hits"] > 0 and metrics["running"] == 0
            assert "radixkv_kv_cache_usage" in engine.metrics_text()
            engine.check_invariants()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def stop_strings_in(texts: list[str], at: int) -> list[str]:
    """A two-character stop string from each text, starting at character `at` or after it (a
    character the byte tokenizer's random bytes made whole, not U+FFFD)."""
    stops = []
    for text in texts:
        i = at
        while "\ufffd" in text[i : i + 2]:
            i += 1
        assert len(text[i : i + 2]) == 2, f"no whole two characters in {text!r} from {at}"
        stops.append(text[i : i + 2])
    return stops


def test_stop_strings_are_found_by_the_front_end_and_the_core_stops_the_sample(model_folders):
    """The core never decodes (its decode raises here): the front end finds each sample's stop
    string in the tokens the core streams and ends the sample there, as the in-process engine
    does (tokens, text, logprobs, finish reasons), and the core stops the sample: a request of
    120 tokens whose samples all stopped early ends within a few steps, and its id is free at once."""
    config = EngineConfig(model=str(model_folders["llama"]), **KW)
    sync = Engine(config)
    free = SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=3, ignore_eos=True, logprobs=1)
    texts = [s.text for s in sync.generate([[3, 1, 4]], free)[0].samples]
    some = dataclasses.replace(free, stop=stop_strings_in(texts[:2], 6))  # sample 2 may run on
    every = dataclasses.replace(free, max_tokens=120, stop=stop_strings_in(texts, 3))
    greedy = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    greedy = dataclasses.replace(greedy, stop=stop_strings_in([sync.generate([[2, 7]], GREEDY)[0].text], 2))
    want_some, want_every, want_greedy = (
        sync.generate([p], params)[0]
        for p, params in (([3, 1, 4], some), ([3, 1, 4], every), ([2, 7], greedy))
    )
    want_stream = [(d.token_id, d.text, d.finish_reason) for d in sync.stream([2, 7], greedy)]

    def samples(out) -> list[tuple]:
        """Each sample's tokens, text, finish reason and logprob records' tokens (their values
        depend on what the cache held, which differs between the two engines' runs)."""
        return [
            (s.token_ids, s.text, s.finish_reason, [r.token_id for r in s.logprobs or ()])
            for s in out.samples
        ]

    async def main() -> None:
        engine = AsyncEngine(config, core_setup=forbid_decoding)
        try:
            assert samples(await engine.generate([3, 1, 4], some)) == samples(want_some)
            assert [s.finish_reason for s in want_some.samples][:2] == ["stop", "stop"]
            for params, want in ((every, want_every), (greedy, want_greedy)):
                steps = engine.core.num_steps
                assert samples(
                    await engine.generate(
                        [3, 1, 4] if params is every else [2, 7], params, request_id="again"
                    )
                ) == samples(want)
                assert {s.finish_reason for s in want.samples} == {"stop"}
                assert engine.core.num_steps - steps < 40  # of 120: the core stopped every sample
            stream = [(d.token_id, d.text, d.finish_reason) async for d in engine.stream([2, 7], greedy)]
            assert stream == want_stream
            engine.check_invariants()
            metrics = engine.metrics()
            assert metrics["running"] == 0
            # Each of the four requests is in the latency histograms, however the core ended it.
            assert metrics["e2e_request_latency_seconds"]["count"] == 4
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_abort_and_cancel_reach_the_core(model_folders):
    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=str(model_folders["llama"]), **KW))
        try:
            deltas = []
            async for delta in engine.stream([1, 2, 3], LONG, request_id="cut"):
                deltas.append(delta)
                if len(deltas) == 2:
                    engine.abort("cut")
            assert deltas[-1].finish_reason == "abort" and len(deltas) < 50
            task = asyncio.create_task(engine.generate([3, 2, 1], LONG))
            deadline = time.monotonic() + 30
            while engine.num_running_seqs() == 0:
                assert time.monotonic() < deadline, "the request never ran"
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while (m := engine.metrics())["running"] + m["waiting"]:
                assert time.monotonic() < deadline, "the cancelled request was not aborted"
                await asyncio.sleep(0.01)
            engine.check_invariants()
            out = await engine.generate([1, 2, 3], GREEDY, request_id="cut")  # the id is free again
            assert len(out.token_ids) == 6
        finally:
            await engine.shutdown()

    asyncio.run(main())


class HeldReader:
    """Holds the front end's reader thread in its next dispatch until `release`, so that the core
    runs on and its messages wait in the socket; counts the dispatches."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.dispatch, self.calls = engine.core.on_update, 0
        self.held, self.released = threading.Event(), threading.Event()
        self.hold_next = True
        engine.core.on_update = self

    def __call__(self, requests) -> None:
        self.calls += 1
        if self.hold_next:
            self.hold_next = False
            self.held.set()
            assert self.released.wait(120), "the test never released the reader"
        self.dispatch(requests)


def test_a_reader_behind_the_core_takes_what_waits_at_once_and_an_abort_still_closes(model_folders):
    """With the reader held in its first dispatch, the core makes the rest of a request (and, in a
    second request, several tokens and then an abort): once released, the reader applies every
    waiting message and dispatches once. The stream's tokens are the in-process engine's, and an
    aborted stream still ends with its closing delta (no token), its tokens before it."""
    config = EngineConfig(model=str(model_folders["llama"]), **KW)
    whole, long = ([9, 8, 7, 6], [5, 4, 3])
    twelve, cut = dataclasses.replace(GREEDY, max_tokens=12), dataclasses.replace(GREEDY, max_tokens=400)
    sync = Engine(config)
    want_whole = sync.generate([whole], twelve)[0].token_ids
    want_cut = sync.generate([long], dataclasses.replace(GREEDY, max_tokens=64))[0].token_ids

    async def collect(stream) -> list:
        return [d async for d in stream]

    async def wait(done, what: str) -> None:
        await asyncio.to_thread(wait_for, done, 120, what)

    async def main() -> None:
        engine = AsyncEngine(config)
        try:
            reader = HeldReader(engine)
            task = asyncio.ensure_future(collect(engine.stream(whole, twelve)))
            await wait(reader.held.is_set, "the first dispatch")
            await wait(lambda: engine.metrics()["running"] == 0, "the core finished the request")
            reader.released.set()
            deltas = await asyncio.wait_for(task, 120)
            assert [d.token_id for d in deltas] == want_whole
            assert deltas[-1].finish_reason == "length"
            assert reader.calls == 2  # the held one, then everything else in one

            reader.calls, reader.hold_next = 0, True
            reader.held.clear(), reader.released.clear()
            task = asyncio.ensure_future(collect(engine.stream(long, cut, request_id="cut")))
            await wait(reader.held.is_set, "the first dispatch")
            free = engine.metrics()["num_free_blocks"]
            await wait(lambda: engine.metrics()["num_free_blocks"] <= free - 2, "two more blocks")
            engine.abort("cut")
            await wait(lambda: engine.metrics()["running"] == 0, "the core aborted the request")
            reader.released.set()
            deltas = await asyncio.wait_for(task, 120)
            closing = deltas[-1]
            assert closing.token_id is None and closing.text == "" and closing.finish_reason == "abort"
            made = [d.token_id for d in deltas[:-1]]
            assert len(made) > 4 and made[:64] == want_cut[: len(made)]
            assert all(d.finish_reason is None for d in deltas[:-1])
            assert reader.calls == 2
            engine.check_invariants()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_fatal_after_a_finished_request_hands_the_request_on_before_the_death(model_folders):
    """The reader applies what came before a `Fatal` in the same batch and dispatches it, then
    reports the death: a request the core finished is a result, not an error."""
    engine = AsyncEngine(EngineConfig(model=str(model_folders["llama"]), **KW))
    client = engine.core
    try:
        request = client.make_request([1, 2, 3], GREEDY, "done")
        client._requests["done"] = request  # as `submit` keeps it, without sending it
        order = []
        client.on_update = lambda requests: order.append(("update", [r.request_id for r in requests]))
        client.on_dead = lambda error: order.append(("dead", request.error))
        seq = SeqUpdate(0, pack_ids([7, 8]), None, "length")
        finished = [RequestUpdate("done", [seq], done=Done(1.0, 0.5))]
        waiting = [msgspec.msgpack.encode(m) for m in (StepOutput(finished, 0, 1), Fatal("boom"))]

        class Socket:
            def recv(self, flags: int = 0) -> bytes:
                if not waiting:
                    raise zmq.Again()
                return waiting.pop(0)

        client._take_waiting(Socket())
        assert order == [("update", ["done"]), ("dead", None)]
        assert request.status is Status.FINISHED and request.finished_seqs[0].output_ids == [7, 8]
    finally:
        client._dead = None  # the real core is alive: shut it down as usual
        asyncio.run(engine.shutdown())


def test_a_failed_step_fails_only_its_requests_and_a_broken_book_is_reported(model_folders):
    from core_faults import break_the_books, poison_forward  # found by the core: it has our sys.path

    async def main() -> None:
        config = EngineConfig(model=str(model_folders["llama"]), **KW)
        engine = AsyncEngine(config, core_setup=poison_forward)
        try:
            with pytest.raises(RequestError, match="poisoned forward"):
                await engine.generate([1, POISON, 3], GREEDY)
            stream = engine.stream([POISON, 2], GREEDY)
            with pytest.raises(RequestError, match="poisoned forward"):
                async for _ in stream:
                    pass
            out = await engine.generate([1, 2, 3], GREEDY)  # the engine stays usable
            assert len(out.token_ids) == 6
            engine.check_invariants()
        finally:
            await engine.shutdown()
        broken = AsyncEngine(config, core_setup=break_the_books)
        try:
            await broken.generate([1, 2, 3], GREEDY)
            with pytest.raises(InvariantError):
                broken.check_invariants()
        finally:
            await broken.shutdown()

    asyncio.run(main())


def test_each_core_is_forked_in_the_callers_directory_and_environment(model_folders, tmp_path, monkeypatch):
    """The launcher is started once; each core it forks sees the directory and environment its
    caller had when the core started, not the launcher's."""
    from core_faults import write_surroundings

    config = EngineConfig(model=str(model_folders["llama"]), **KW)
    seen = []
    for i in range(2):
        folder = tmp_path / str(i)
        folder.mkdir()
        monkeypatch.chdir(folder)
        monkeypatch.setenv("RADIXKV_TEST_MARK", f"mark {i}")

        async def main() -> None:
            engine = AsyncEngine(config, core_setup=write_surroundings)
            try:
                assert len((await engine.generate([1, 2, 3], GREEDY)).token_ids) == 6
            finally:
                await engine.shutdown()

        asyncio.run(main())
        seen.append(json.loads((folder / "surroundings.json").read_text()))
    want = [(str(tmp_path / "0"), "mark 0"), (str(tmp_path / "1"), "mark 1")]
    assert [(s["cwd"], s["mark"]) for s in seen] == want
    assert seen[0]["pid"] != seen[1]["pid"] != os.getpid()
    assert exited(seen[0]["pid"]) and exited(seen[1]["pid"])


def test_a_core_outlives_its_killed_launcher_and_the_next_core_gets_a_new_one(model_folders):
    """The launcher is only the cores' starter: killed, its core keeps serving and shuts down at
    once (nobody reports its exit: its pidfd tells), and the next engine starts a new launcher."""
    from radixkv.engine.process import launcher

    config = EngineConfig(model=str(model_folders["llama"]), **KW)

    async def main() -> None:
        first = AsyncEngine(config)
        old = launcher.start()
        old.process.kill()
        old.process.wait(timeout=30)
        assert len((await first.generate([1, 2, 3], GREEDY)).token_ids) == 6
        await asyncio.wait_for(first.shutdown(), 10)  # not the 60 s of a wait for a report
        assert first.core.process.poll() is not None
        second = AsyncEngine(config)
        try:
            assert launcher.start() is not old
            assert len((await second.generate([1, 2, 3], GREEDY)).token_ids) == 6
        finally:
            await second.shutdown()

    asyncio.run(main())


@pytest.mark.slow
def test_a_forked_child_of_the_front_end_does_not_keep_its_launcher_alive(monkeypatch):
    """A launcher ends at EOF on its request pipe, when its front end exits. A child the front
    end forked (multiprocessing's fork start method) lets go of that pipe at the fork, so the
    launcher still ends with its parent while the child lives on. Without that, the launcher
    waited for the child."""
    from radixkv.engine.process import launcher

    fresh = launcher.Launcher()
    monkeypatch.setattr(launcher, "_launcher", fresh)
    child = os.fork()
    if child == 0:  # the child: outlive the parent's use of the launcher by far (it is killed)
        time.sleep(300)
        os._exit(0)
    try:
        fresh.process.stdin.close()  # the parent is done with the launcher, as at its exit
        assert fresh.process.wait(timeout=60) == 0  # its imports first, then EOF
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_killed_core_fails_every_open_request_at_once(model_folders):
    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=str(model_folders["llama"]), **KW))
        pid = engine.core.pid
        streams = [engine.stream([i + 1, 2, 3], LONG) for i in range(4)]
        firsts = await asyncio.wait_for(asyncio.gather(*(anext(s) for s in streams)), 60)
        assert all(d.token_id is not None for d in firsts)
        waiting = asyncio.create_task(engine.generate([7, 7], LONG))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()

        async def drain(stream) -> BaseException | None:
            try:
                async for _ in stream:
                    pass
            except RequestError as e:
                return e
            return None

        errors = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 3)
        assert all(isinstance(e, RequestError) and isinstance(e.__cause__, EngineDeadError) for e in errors)
        assert "exit code -9" in str(errors[0].__cause__)  # the launcher reaped it and told us how
        with pytest.raises(RequestError):
            await asyncio.wait_for(waiting, 3)
        assert time.monotonic() - killed < 3
        assert not engine.is_alive()
        with pytest.raises(EngineDeadError):
            await engine.generate([1, 2], GREEDY)
        with pytest.raises(EngineDeadError):
            engine.metrics()
        await asyncio.wait_for(engine.shutdown(), 30)

    asyncio.run(main())


# ------------------------------------------------------------------------ radixkv serve


def test_metrics_wait_for_the_step_in_flight_without_holding_the_event_loop(model_folders):
    """A scrape waits for the core's step in flight (half a second here); /health, asked after
    it, answers before it: the scrape's wait is off the event loop."""
    from core_faults import slow_forward

    from radixkv.server.app import build_app

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=str(model_folders["llama"]), **KW), core_setup=slow_forward)
        app = build_app(engine, "tiny")
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://x", timeout=60) as http:
                stream = engine.stream([1, 2, 3], LONG)
                await asyncio.wait_for(anext(stream), 60)  # steps run back to back from here
                order = []

                async def get(path: str) -> None:
                    assert (await http.get(path)).status_code == 200
                    order.append(path)

                scrape = asyncio.create_task(get("/metrics"))
                await asyncio.sleep(0)  # the scrape is on its way to the core
                await asyncio.wait_for(asyncio.gather(scrape, get("/health")), 60)
                assert order == ["/health", "/metrics"]
                await stream.aclose()
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.slow  # a server process of its own: beyond the fast tier's one smoke test
def test_kill_9_of_the_core_ends_every_stream_with_an_error_and_the_server_exits(model_folders, tmp_path):
    with serve(model_folders["llama"], tmp_path / "serve.log", *SERVE, check_exit=False) as (url, proc):
        launcher, core = launcher_and_core(proc.pid)

        async def main() -> tuple[list[list[str]], float]:
            started = [asyncio.Event() for _ in range(4)]

            async def read(http: httpx.AsyncClient, i: int) -> list[str]:
                body = {"prompt": [i + 1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "stream": True}
                lines = []
                async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            lines.append(line)
                            started[i].set()
                return lines

            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [asyncio.create_task(read(http, i)) for i in range(4)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                os.kill(core, signal.SIGKILL)
                killed = time.monotonic()
                streams = await asyncio.wait_for(asyncio.gather(*tasks), 3)
                return streams, time.monotonic() - killed

        streams, took = asyncio.run(main())
        assert took < 3
        for lines in streams:
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][len("data: ") :])["error"]["code"] == "engine_dead"
        rc = proc.wait(timeout=30)  # its streams ended within 3 s, above; exiting may take longer under load
        assert rc != 0
        wait_for(lambda: exited(core) and exited(launcher), 30, "the core or its launcher did not exit")
    assert "the engine died" in (tmp_path / "serve.log").read_text()


@pytest.mark.slow  # a server process of its own: beyond the fast tier's one smoke test
def test_sigterm_stops_the_core_and_leaves_no_process(model_folders, tmp_path):
    with serve(model_folders["llama"], tmp_path / "serve.log", *SERVE, check_exit=False) as (url, proc):
        launcher, core = launcher_and_core(proc.pid)
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_for(lambda: exited(core) and exited(launcher), 10, "the core or its launcher did not exit")


@pytest.mark.slow  # a server process of its own: beyond the fast tier's one smoke test
def test_a_core_whose_server_is_killed_exits_by_itself(model_folders, tmp_path):
    with serve(model_folders["llama"], tmp_path / "serve.log", *SERVE, check_exit=False) as (_, proc):
        launcher, core = launcher_and_core(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: exited(core) and exited(launcher), 10, "the orphaned core or launcher did not exit")
