"""The front end's side of an engine core in its own process: `CoreClient`.

It stands where an `EngineCore` stands for `AsyncEngine`: `make_request` validates and
tokenizes here (`radixkv.engine.input_processor`, with the numbers the core sent in `Ready`), `submit`,
`abort` and `close_session` only send, and a reader thread receives each step's `StepOutput`,
applies it to the front end's copies of the requests (their sequences' tokens, logprob records,
finish reasons) and hands the requests it touched to `on_update`, as a stepping thread would.
Texts are made from those copies where they are read (`radixkv.engine.output_processor`).

Stop strings are found here, not in the core, as vLLM's front end finds them: a request with
stop strings goes to the core without them, streamed step by step, and each step's tokens are
pushed through the copy's detokenizer as they arrive. A sample whose text completes a stop
string ends here at that token (its tokens, logprob records and text cut there, finish_reason
"stop"), and a `StopSample` tells the core, which stops it at its next token; the tokens the
core made past the stop are dropped. Once every sample has stopped so, the request ends here at
once. The core ends it too as soon as the last `StopSample` comes, before it reads the next
message, so a new request may take the id at once; what the core still sends of the old one is
dropped here, up to its end.

Watching the core. The reader thread also polls the process's liveness (`PARENT_CHECK_S`
apart at most, and at once when it exits): when the core dies (a crash, SIGKILL, the OOM
killer) or reports `Fatal`, `on_dead` gets an `EngineDeadError` once, every later call raises
it, and `is_alive()` is False. Control calls (`metrics`, `check_invariants`) wait for the step in
flight and fail with EngineDeadError if the core dies meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from radixkv.config import EngineConfig
from radixkv.engine.input_processor import InputProcessor, Params, Prompt
from radixkv.engine.output_processor import result_of, stream_deltas
from radixkv.engine.process import launcher
from radixkv.engine.process.core_process import PARENT_CHECK_S
from radixkv.engine.process.messages import (
    Abort,
    AddRequest,
    CloseSession,
    ControlCall,
    ControlReply,
    Fatal,
    FromCore,
    Ready,
    RequestUpdate,
    Shutdown,
    StepOutput,
    StopSample,
    pack_ids,
    unpack_ids,
)
from radixkv.errors import EngineDeadError, InvariantError, RequestError
from radixkv.model.loader import load_tokenizer
from radixkv.model.tokenizer_threads import PerThreadTokenizer
from radixkv.outputs import Beam, RequestOutput, StreamDelta
from radixkv.sampling_params import SamplingParams
from radixkv.scheduler.request import Request, Sequence, Status
from radixkv.structured.grammar import GrammarCompiler

STARTUP_TIMEOUT_S = 600.0  # building the core loads the model (and profiles memory on a GPU)
CONTROL_TIMEOUT_S = 300.0  # a control call waits for the step in flight, however slow
SHUTDOWN_TIMEOUT_S = 60.0  # the core writes its KV store out and stops its workers
MAX_MESSAGES_AT_ONCE = 64  # a reader behind the core applies at most this many before it dispatches


class CoreError(RuntimeError):
    """An exception raised inside the engine core's process, by its class name and message: the
    `__cause__` of a `RequestError` from a core in its own process."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


class CoreClient:
    """Starts the core process for `config` and talks to it. `setup(core)` runs in the child
    once the core is built (it must be picklable: a module-level function or a partial)."""

    def __init__(
        self, config: EngineConfig | None = None, setup: Callable[[Any], None] | None = None
    ) -> None:
        self.config = config = config or EngineConfig()
        tokenizer = load_tokenizer(config.model)
        self.tokenizer = PerThreadTokenizer(tokenizer) if tokenizer is not None else None
        self.on_update: Callable[[list[Request]], None] | None = None
        self.on_dead: Callable[[BaseException], None] | None = None
        self.running_seqs = 0
        self.num_steps = 0
        self._requests: dict[str, Request] = {}  # the front end's copies, submitted and not yet taken
        self._ending: set[str] = set()  # requests ended here whose end has not come from the core yet
        self._send_lock = threading.Lock()
        self._control_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._folder = tempfile.mkdtemp(prefix="radixkv-core-")
        addresses = tuple(f"ipc://{self._folder}/{name}" for name in ("in", "out", "control"))
        self._context = zmq.Context()
        self._to_core = self._bind(zmq.PUSH, addresses[0])
        self._from_core = self._bind(zmq.PULL, addresses[1])
        self._control = self._bind(zmq.REQ, addresses[2])
        # Forked by the launcher, which has imported the engine already (`launcher`); it exits
        # on its own when this process is gone (`core_process`).
        core_args = pickle.dumps((config, addresses, os.getpid(), setup))
        try:
            self.process = launcher.launch(core_args)
        except BaseException:
            self._release()
            raise
        try:
            ready = self._wait_ready()
        except BaseException:
            self._stop_process()
            self._release()
            raise
        self.pid = ready.pid
        self.eos_token_ids = ready.eos_token_ids
        self.vocab_size = ready.vocab_size
        self.max_model_len = ready.max_model_len
        self.inputs = InputProcessor(
            self.tokenizer,
            ready.vocab_size,
            ready.max_model_len,
            config.max_num_seqs,
            ready.num_blocks,
            ready.block_size,
            windows=tuple(ready.windows),
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.reader = threading.Thread(target=self._read, name="radixkv-core-reader", daemon=True)
        self.reader.start()

    def _bind(self, kind: int, address: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUSH:
            sock.setsockopt(zmq.SNDHWM, 0)
        else:
            sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(address)
        return sock

    def _wait_ready(self) -> Ready:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._from_core.poll(int(PARENT_CHECK_S * 1000)):
                message = self._decoder.decode(self._from_core.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, Fatal):
                    if message.invalid:  # the config was refused: a ValueError naming it
                        raise ValueError(message.invalid)
                    raise RuntimeError(f"the engine core failed to start:\n{message.message}")
            elif self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"the engine core process exited with {code} while starting")
        raise RuntimeError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler over the front end's tokenizer, for checking specs at the
        door (`EngineCore.grammars`; the core compiles its own matchers)."""
        if self.tokenizer is None:
            raise ValueError("structured output needs a model with a tokenizer")
        return GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)

    # ------------------------------------------------------------- requests

    def make_request(
        self, prompt: Prompt, params: Params | None, request_id: str | None = None, **kw: Any
    ) -> Request:
        """As `EngineCore.make_request`, checked here against the core's numbers."""
        return self.inputs.make_request(prompt, params, request_id, in_use=self._requests, **kw)

    def submit(self, requests: list[Request], stream: bool = False) -> list[str]:
        """Sends the requests to the core; `stream` asks for their tokens step by step (and
        stop strings do, which the core never sees)."""
        self._check_alive()
        taken = next((r.request_id for r in requests if r.request_id in self._requests), None)
        if taken is not None:
            raise ValueError(f"request_id {taken!r} is already in use")
        messages = []
        for r in requests:
            params, stops = r.params, isinstance(r.params, SamplingParams) and bool(r.params.stop)
            if stops:
                params = dataclasses.replace(params, stop=[])
            messages.append(
                AddRequest(
                    r.request_id,
                    pack_ids(r.prompt_ids),
                    pickle.dumps(params),
                    "beam_search" if r.is_beam_search else "stream" if stream else "generate",
                    stream or stops,
                    r.arrival_time,
                    r.session_id,
                    r.cache_salt,
                )
            )
            self._requests[r.request_id] = r
        for message in messages:
            self._send(message)
        return [r.request_id for r in requests]

    def abort(self, request_id: str, *, wait: bool = False) -> None:
        """Queues the abort in the core (never waits: the core's next step does it)."""
        self._send(Abort([request_id]))

    def close_session(self, session_id: str, *, wait: bool = False) -> None:
        self._send(CloseSession(session_id))

    def take(self, request_id: str) -> Request:
        request = self._requests.pop(request_id)
        if request.error is not None:
            raise request.error
        return request

    def result_of(self, request: Request) -> RequestOutput | list[Beam]:
        return result_of(request, self.inputs.decode)

    def stream_deltas(
        self, request: Request, seq: Sequence, start: int, end: int, finished: bool
    ) -> list[StreamDelta]:
        return stream_deltas(request, seq, start, end, finished)

    def decode(self, ids: list[int]) -> str:
        return self.inputs.decode(ids)

    def _send(self, message: Any, block: bool = True) -> None:
        """Sends to the core. The reader thread sends with `block` False: a dead core's socket has
        no peer, and a blocking send would then wait forever, before the reader sees the death."""
        if self._dead is not None or self._closing:
            return  # nothing to stop any more; callers learn of the death through their requests
        data = self._encoder.encode(message)
        with self._send_lock, contextlib.suppress(zmq.Again):  # Again: no core; the reader finds its death
            self._to_core.send(data, 0 if block else zmq.NOBLOCK, copy=False)

    # -------------------------------------------------------------- control

    def metrics(self) -> dict:
        return self._call("metrics")

    def metrics_text(self) -> str:
        return self._call("metrics_text")

    def check_invariants(self) -> None:
        self._call("check_invariants")

    def dashboard(self, namespaces: list[int] | None = None) -> dict:
        return self._call("dashboard", namespaces)

    def _call(self, method: str, *args: Any) -> Any:
        with self._control_lock:
            self._check_alive()
            self._control.send(self._encoder.encode(ControlCall(method, args)))
            deadline = time.monotonic() + CONTROL_TIMEOUT_S
            while not self._control.poll(int(PARENT_CHECK_S * 1000)):
                self._check_alive()
                if self.process.poll() is not None:
                    self._check_alive(EngineDeadError("the engine core process died during a control call"))
                if time.monotonic() > deadline:
                    limit = CONTROL_TIMEOUT_S
                    raise TimeoutError(f"the engine core did not answer {method} within {limit:.0f} s")
            reply = msgspec.msgpack.decode(self._control.recv(), type=ControlReply)
        if reply.error is not None:
            if reply.error_type == "InvariantError":
                raise InvariantError(reply.error)
            raise CoreError(reply.error_type or "Exception", reply.error)
        return msgspec.msgpack.decode(reply.value)

    # ------------------------------------------------------------- lifetime

    def is_alive(self) -> bool:
        return self._dead is None and not self._closing and self.process.poll() is None

    def _check_alive(self, dead: EngineDeadError | None = None) -> None:
        if dead is not None and self._dead is None:
            self._die(dead)
        if self._dead is not None:
            raise self._dead
        if self._closing:
            raise EngineDeadError("the engine is shut down")

    def close(self) -> None:
        """Aborts what runs, shuts the core down (its workers stopped, its store written) and
        waits for it; kills it if it does not exit within `SHUTDOWN_TIMEOUT_S`. Idempotent."""
        if self._closing:
            return
        if self._dead is None:
            with self._send_lock:
                self._to_core.send(self._encoder.encode(Shutdown()))
        self._closing = True
        self._stop_process()
        if threading.current_thread() is not self.reader:
            self.reader.join(timeout=SHUTDOWN_TIMEOUT_S)
        self._release()

    def _stop_process(self) -> None:
        try:
            self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)

    def _release(self) -> None:
        if getattr(self, "process", None) is not None:
            self.process.close()
        self._context.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)

    def _die(self, error: EngineDeadError) -> None:
        self._dead = error
        for request in list(self._requests.values()):
            if request.status is not Status.FINISHED:
                request.error = RequestError(request.request_id, error)
                request.status = Status.FINISHED
        if self.on_dead is not None:
            self.on_dead(error)

    # --------------------------------------------------------------- reader

    def _read(self) -> None:
        """The reader thread: applies each StepOutput, and watches the process."""
        sock, sentinel = self._from_core, self.process.sentinel
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if sentinel is not None:
            poller.register(sentinel, zmq.POLLIN)  # readable once the process has exited
        while self._dead is None:
            events = dict(poller.poll(PARENT_CHECK_S * 1000))
            if sock in events:
                self._take_waiting(sock)
                continue  # read everything it sent before looking at how it ended
            if sentinel in events or self.process.poll() is not None:
                if self._closing:
                    return
                code = self.process.wait()
                self._die(EngineDeadError(f"the engine core process died (exit code {code})"))

    def _take_waiting(self, sock: zmq.Socket) -> None:
        """Applies the messages waiting (`MAX_MESSAGES_AT_ONCE` at most), then hands on the
        requests they touched in one `on_update`: a reader behind the core catches up in one
        dispatch, and a stream gets the tokens of several steps together. A `Fatal` ends the
        batch; what came before it is handed on first, then the core's death."""
        touched: dict[str, Request] = {}
        fatal = None
        for _ in range(MAX_MESSAGES_AT_ONCE):
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = self._decoder.decode(data)
            if isinstance(message, Fatal):
                fatal = message
                break
            if isinstance(message, StepOutput):
                self._apply_step(message, touched)
        if self._dead is not None:
            return  # another thread found the death meanwhile and failed every open request
        if touched and self.on_update is not None:
            self.on_update(list(touched.values()))
        if fatal is not None:
            self._die(EngineDeadError(f"the engine core's loop broke:\n{fatal.message}"))

    def _apply_step(self, message: StepOutput, touched: dict[str, Request]) -> None:
        self.running_seqs = message.running_seqs
        self.num_steps = message.num_steps
        for update in message.updates:
            if update.request_id in self._ending:  # news of a request ended here, all past its end
                if update.done is not None:
                    self._ending.discard(update.request_id)
                continue
            request = self._requests.get(update.request_id)
            if request is not None and request.status is not Status.FINISHED:
                self._apply(request, update)
                touched[request.request_id] = request

    def _apply(self, request: Request, update: RequestUpdate) -> None:
        """Brings the front end's copy up to the core's: tokens appended and, with stop strings,
        pushed (a reader sees a length only after its tokens), finish reasons, scores and times
        at the end; a request whose samples all stopped here ends here."""
        if update.num_cached_tokens is not None:
            request.num_cached_tokens = update.num_cached_tokens
        if update.prompt_logprobs is not None:
            request.prompt_logprobs = update.prompt_logprobs
        done = update.done
        stops = not request.is_beam_search and bool(request.params.stop)
        finished = []
        for s in update.seqs:
            seq = self._seq(request, s.index, fresh=done is not None and request.is_beam_search)
            if seq.finish_reason == "stop" and stops:  # stopped here: the core's tokens run past it
                finished.append(seq)
                continue
            seq.tokens.extend(unpack_ids(s.tokens))
            if s.logprobs is not None and seq.token_logprobs is not None:
                seq.token_logprobs.extend(s.logprobs)
            if done is not None:
                seq.finish_reason, seq.score = s.finish_reason, s.score
                finished.append(seq)
            if stops and self._stop_here(request, seq) and done is None:
                self._send(StopSample(request.request_id, seq.index), block=False)
        if stops and request.first_token_time is None and update.seqs:
            # Kept only if the request ends here (its times are then this process's, when the
            # tokens arrived); the core's own times come with an end the core sends.
            request.first_token_time = time.perf_counter()
        if done is None:
            if stops and not request.seqs and len(request.finished_seqs) == request.params.n:
                request.finish_time = time.perf_counter()
                request.status = Status.FINISHED
                self._ending.add(request.request_id)
            return
        request.first_token_time = done.first_token_time
        request.finish_time = done.finish_time
        if done.error is not None:
            cause = CoreError(done.error_type or "Exception", done.error)
            request.error = RequestError(request.request_id, cause)
        request.finished_seqs = finished
        request.status = Status.FINISHED

    @staticmethod
    def _stop_here(request: Request, seq: Sequence) -> bool:
        """Pushes `seq`'s new tokens through its detokenizer; if one completes a stop string,
        cuts the sequence after it and finishes it ("stop"; out of `request.seqs` while running)."""
        end = seq.detok.push_to_stop(seq.tokens)
        if end is None:
            return False
        del seq.tokens[end:]
        if seq.token_logprobs is not None:
            del seq.token_logprobs[end - seq.num_prompt_tokens :]
        request.seqs.remove(seq)
        request.finish_seq(seq, "stop")
        return True

    @staticmethod
    def _seq(request: Request, index: int, fresh: bool) -> Sequence:
        """The copy's sequence `index` (sample `index` of n, made at its first news; one stopped
        here stays among the finished), or a new one for a finished beam."""
        if fresh:
            return Sequence(list(request.prompt_ids), len(request.prompt_ids))
        for seq in (*request.seqs, *request.finished_seqs):
            if seq.index == index:
                return seq
        first = (request.seqs or request.finished_seqs)[0]
        seq = Sequence(
            list(request.prompt_ids),
            len(request.prompt_ids),
            index=index,
            detok=first.detok.fork() if first.detok is not None else None,
            token_logprobs=[] if first.token_logprobs is not None else None,
        )
        request.seqs.append(seq)
        return seq
