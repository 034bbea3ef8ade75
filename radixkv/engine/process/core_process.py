"""The engine core's process: builds the `EngineCore` and steps it, fed by the front end.

The loop: take every queued message (requests, aborts, stops, session closes, control calls),
step once if there is work, and send one `StepOutput` with what the step changed (a `StopSample`
that ends its request sends one at once, before the next message is read); with no work it
sleeps in `poll` (no CPU used), waking for a message or every `PARENT_CHECK_S` to see that its
front end still lives. A request that fails to build here (it passed the front end's checks, so
only a bug or a reused id does that) ends at once with its error; a step's failure is contained
by the core, as in process. A loop that breaks outside a step sends `Fatal` and exits non-zero,
and the front end then fails every open request.

Lifetime. The process is forked by the front end's launcher (`launcher`) and ignores SIGINT
and SIGTERM (a supervisor's signal to the whole group belongs to the front end, which stops the
core in order); it ends on `Shutdown`, or by itself as soon as the front end is gone (its pidfd
turns readable in the loop's poll, or, without pidfds, a signal 0 to it fails: it was killed),
closing the core either way, which stops its tensor-parallel workers.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from radixkv.config import EngineConfig
from radixkv.engine.process.messages import (
    Abort,
    AddRequest,
    CloseSession,
    ControlCall,
    ControlReply,
    Done,
    Fatal,
    FromCore,
    Ready,
    RequestUpdate,
    SeqUpdate,
    Shutdown,
    StepOutput,
    StopSample,
    ToCore,
    pack_ids,
)
from radixkv.errors import RequestError
from radixkv.scheduler.request import Request, Status

PARENT_CHECK_S = 0.2
IDLE_STEPS_BEFORE_STALL = 3  # steps in a row that run nothing while requests wait
CONTROL_METHODS = ("metrics", "metrics_text", "check_invariants", "dashboard")


def step_watching_stalls(core: Any, idle: int) -> int:
    """Steps `core` once; returns the steps in a row that ran nothing while requests waited.
    After `IDLE_STEPS_BEFORE_STALL` of them, the waiting requests can never be scheduled: they
    fail, rather than the loop spinning."""
    before = core.num_steps
    core.step()
    idle = idle + 1 if core.num_steps == before and core.scheduler.has_work() else 0
    if idle >= IDLE_STEPS_BEFORE_STALL:
        core.fail_waiting(RuntimeError("the engine cannot schedule these requests"))
        idle = 0
    return idle


class _Sent:
    """What the front end has of one request: generated tokens per sequence index."""

    __slots__ = ("cached_sent", "prompt_logprobs_sent", "stream", "tokens")

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.tokens: dict[int, int] = {}
        self.cached_sent = False
        self.prompt_logprobs_sent = False


class FrontEndWatch:
    """Tells whether the front end (by pid) still lives: its pidfd, readable once it has exited,
    which the loop's poll also waits on; without pidfds, a signal 0 each look."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
            self._gone = False
        except ProcessLookupError:
            self.fd, self._gone = None, True
        except (AttributeError, OSError):
            self.fd, self._gone = None, False

    def gone(self) -> bool:
        if self._gone:
            return True
        if self.fd is not None:
            self._gone = bool(select.select([self.fd], [], [], 0)[0])
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._gone = True
            except PermissionError:
                pass  # alive, someone else's
        return self._gone


class CoreProcess:
    """The child's side: `run` until shut down or orphaned. `setup(core)`, if given, runs once
    the core is built (a benchmark's stub model, say); it must be picklable."""

    def __init__(
        self, config: EngineConfig, addresses: tuple[str, str, str], front_end: FrontEndWatch
    ) -> None:
        self.config = config
        self.front_end = front_end
        self.context = zmq.Context()
        self.inbox = self._socket(zmq.PULL, addresses[0])
        self.outbox = self._socket(zmq.PUSH, addresses[1])
        self.control = self._socket(zmq.REP, addresses[2])
        self.decoder = msgspec.msgpack.Decoder(ToCore)
        self.control_decoder = msgspec.msgpack.Decoder(ControlCall)
        self.encoder = msgspec.msgpack.Encoder()
        self.core: Any = None
        self.sent: dict[str, _Sent] = {}
        self.touched: dict[str, Request] = {}
        self.failed: list[RequestUpdate] = []
        self.stopping = False
        self.running_sent = 0

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 1000)
        if kind == zmq.PUSH:
            sock.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
        sock.connect(address)
        return sock

    def send(self, message: FromCore) -> None:
        self.outbox.send(self.encoder.encode(message), copy=False)

    def run(self, setup: Callable[[Any], None] | None) -> int:
        from radixkv.engine.core import EngineCore  # here: the parent's import of this module stays light

        try:
            self.core = core = EngineCore(self.config)
            if setup is not None:
                setup(core)
        except BaseException as e:
            self.send(Fatal(traceback.format_exc(), str(e) if isinstance(e, ValueError) else ""))
            return 1
        core.on_update = self._on_update
        self.send(
            Ready(
                core.vocab_size,
                core.max_model_len,
                list(core.eos_token_ids),
                core.pool.num_blocks,
                core.config.block_size,
                os.getpid(),
                list(core.kv.windows),
            )
        )
        try:
            self._loop()
        except BaseException:
            self.send(Fatal(traceback.format_exc()))
            return 1
        finally:
            core.close()
            self.context.destroy(linger=1000)
        return 0

    def _loop(self) -> None:
        core, idle = self.core, 0
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        if self.front_end.fd is not None:
            poller.register(self.front_end.fd, zmq.POLLIN)
        while not self.stopping:
            timeout = 0 if core.has_work() or self.failed else PARENT_CHECK_S * 1000
            events = dict(poller.poll(timeout))
            if self.front_end.gone():
                return  # nobody reads what we would make
            if self.inbox in events:
                self._drain_inbox()
            if self.control in events:
                self._answer_control()
            if core.has_work():
                idle = step_watching_stalls(core, idle)
            self._flush()

    # ------------------------------------------------------------------ inbox

    def _drain_inbox(self) -> None:
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self.decoder.decode(frame.buffer)
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, Abort):
                for request_id in message.request_ids:
                    self.core.abort(request_id, wait=False)
            elif isinstance(message, StopSample):
                # At once, and its end sent: the front end has ended the request, and the next
                # message may be a new request with its id.
                self.core.stop_sample(message.request_id, message.index)
                self._flush()
            elif isinstance(message, CloseSession):
                self.core.close_session(message.session_id, wait=False)
            elif isinstance(message, Shutdown):
                self.stopping = True
                return

    def _add(self, message: AddRequest) -> None:
        try:
            ids = list(memoryview(message.prompt).cast("i"))
            request = self.core.make_request(
                ids,
                pickle.loads(message.params),
                message.request_id,
                call=message.call,
                session_id=message.session_id,
                cache_salt=message.cache_salt,
            )
            request.arrival_time = message.arrival_time
            self.sent[request.request_id] = _Sent(message.stream)
            self.core.submit([request])
        except Exception as exc:  # the front end checked it: a reused id, or a bug
            self.sent.pop(message.request_id, None)
            done = Done(finish_time=0.0, error=str(exc), error_type=type(exc).__name__)
            self.failed.append(RequestUpdate(message.request_id, [], done=done))

    def _answer_control(self) -> None:
        call = self.control_decoder.decode(self.control.recv())
        reply = ControlReply()
        try:
            if call.method not in CONTROL_METHODS:
                raise ValueError(f"unknown control call {call.method!r}")
            reply.value = msgspec.Raw(self.encoder.encode(getattr(self.core, call.method)(*call.args)))
        except Exception as exc:
            reply.error, reply.error_type = str(exc), type(exc).__name__
        self.control.send(self.encoder.encode(reply))

    # ----------------------------------------------------------------- outbox

    def _on_update(self, requests: list[Request]) -> None:
        for request in requests:
            self.touched[request.request_id] = request

    def _flush(self) -> None:
        """One StepOutput with every touched request's news, if there is any (or a new count of
        running sequences)."""
        updates, self.failed = self.failed, []
        for request in self.touched.values():
            update = self._update(request)
            if update is not None:
                updates.append(update)
        self.touched.clear()
        running = self.core.scheduler.num_running_seqs
        if updates or running != self.running_sent:  # the front end's admission count reads it
            self.running_sent = running
            self.send(StepOutput(updates, running, self.core.num_steps))

    def _update(self, request: Request) -> RequestUpdate | None:
        sent = self.sent.get(request.request_id)
        if sent is None:
            return None
        finished = request.status is Status.FINISHED
        if not finished and not sent.stream:
            return None  # a request not streamed hears of its end only
        update = RequestUpdate(request.request_id, [])
        if request.num_cached_tokens is not None and not sent.cached_sent:
            sent.cached_sent = True
            update.num_cached_tokens = request.num_cached_tokens
        if finished:
            del self.sent[request.request_id]
            update.done = self._done(request)
            seqs = request.finished_seqs
        else:
            seqs = request.seqs
        for seq in seqs:
            start = 0 if request.is_beam_search else sent.tokens.get(seq.index, 0)
            end = len(seq.tokens) - seq.num_prompt_tokens
            if end == start and not finished:
                continue
            sent.tokens[seq.index] = end
            base = seq.num_prompt_tokens
            records = seq.token_logprobs[start:end] if seq.token_logprobs is not None else None
            update.seqs.append(
                SeqUpdate(
                    seq.index,
                    pack_ids(seq.tokens[base + start : base + end]),
                    records,
                    seq.finish_reason if finished else None,
                    seq.score,
                )
            )
        records = request.prompt_logprobs
        if records is not None and not sent.prompt_logprobs_sent and (update.seqs or finished):
            sent.prompt_logprobs_sent = True
            update.prompt_logprobs = records
        return update

    def _done(self, request: Request) -> Done:
        done = Done(request.finish_time, request.first_token_time)
        try:
            self.core.take(request.request_id)
        except RequestError as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            done.error, done.error_type = str(cause), type(cause).__name__
        return done


def main(core_args: bytes) -> int:
    """The core's entry in a child the launcher forked: `core_args` is the pickle of (config,
    the three socket addresses, the front end's pid, setup or None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config, addresses, front_pid, setup = pickle.loads(core_args)
    front_end = FrontEndWatch(front_pid)
    if front_end.gone():
        return 1  # the front end died before we started
    return CoreProcess(config, addresses, front_end).run(setup)
