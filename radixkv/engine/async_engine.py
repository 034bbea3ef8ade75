"""The asyncio engine: coroutines submit; the engine core steps in a process of its own (the
default) or in a background thread of this one.

Where the core runs. By default (`engine_process=True`) the core lives in a child process
(`radixkv.engine.process`): this process validates, tokenizes, detokenizes and streams, and the
step never waits for that work's interpreter lock. A reader thread receives each step's news and
hands it on exactly as the loop thread below does, so everything else here is the same in both
modes. If the core process dies, every open request fails at once with a `RequestError`
(caused by `EngineDeadError`) and `is_alive()` turns False. `engine_process=False` keeps the
core in this process, stepped by a loop thread, for debugging and for tests that reach into it
(`core` is then the `EngineCore` itself).

Threading model (in process). The loop thread sleeps on an event while there is no work (no CPU used when
idle) and wakes when a request or an abort is queued. It steps while there is work; requests
submitted meanwhile join the next step, and a submitter never waits for the step in flight
(validation runs in the caller, the core's inbox is lock-free for it). Each request has a
handle: the loop thread hands a step's progress (how many tokens a stream has, or the finished
request) to the request's asyncio loop with `call_soon_threadsafe`, one callback per loop and
step; nothing else crosses threads. The caller's coroutine makes the deltas and the result from
it, detokenizing there, so the text costs the step lock nothing.

Every exit path of a caller ends its request: a cancelled `generate`/`beam_search` task and a
`stream` that is closed early, garbage-collected or broken out of abort it (`abort` only queues;
the loop frees the blocks before its next step). A step that fails raises `RequestError` in the
callers of that step's requests only.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from radixkv.chat_session import AsyncChatSession
from radixkv.config import EngineConfig
from radixkv.dashboard.cache_view import finish_view
from radixkv.engine.core import EngineCore
from radixkv.engine.input_processor import Prompt
from radixkv.engine.process.core_client import CoreClient
from radixkv.engine.process.core_process import step_watching_stalls
from radixkv.errors import EngineDeadError, RequestError
from radixkv.outputs import Beam, RequestOutput, StreamDelta
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.scheduler.request import Request, Sequence, Status


@dataclass(eq=False)
class _Handle:
    """A caller's side of one request: where the loop thread posts its progress."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None  # the streamed sequence (stream only)
    published: int = 0  # generated tokens the loop thread has announced (stream only)
    done: bool = False  # the final item was posted


@dataclass(slots=True)
class _Progress:
    """Posted to a stream: its first `end` generated tokens are made (the last, if `finished`:
    the stream's last item). The caller's coroutine turns them into deltas, detokenizing there,
    off the step lock."""

    end: int
    finished: bool


class AsyncEngine:
    """`AsyncEngine(config, engine_process=True, core_setup=None)`. `tokenizer`,
    `max_model_len`, `config`, `eos_token_ids` and `vocab_size` are the model's as served.
    `engine_process` runs the core in a child process (module docstring); `core` is then its
    `CoreClient`, else the `EngineCore`. `core_setup(core)`, if given, runs on the `EngineCore`
    once it is built, in whichever process holds it (picklable for a child: a benchmark's stub)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine_process: bool = True,
        core_setup: Callable[[Any], None] | None = None,
    ) -> None:
        self.engine_process = engine_process
        self._handles: dict[str, _Handle] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._fatal: BaseException | None = None
        self.core: Any
        if engine_process:
            self.core = CoreClient(config, core_setup)
            self.core.on_dead = self._fail_all
            self._thread = self.core.reader
        else:
            self.core = EngineCore(config)
            if core_setup is not None:
                core_setup(self.core)
            self.core.on_submit = self._wake.set
            self._thread = threading.Thread(target=self._run, name="radixkv-engine-loop", daemon=True)
        self.core.on_update = self._dispatch
        self.config = self.core.config
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.eos_token_ids = self.core.eos_token_ids
        self.vocab_size = self.core.vocab_size
        if not engine_process:
            self._thread.start()

    @property
    def grammars(self) -> Any:
        """Structured output's compiler (`EngineCore.grammars`), for checking specs ahead."""
        return self.core.grammars

    @property
    def loop_thread(self) -> threading.Thread:
        """The thread that hands the steps' news to callers: the stepping loop in process, the
        reader of the core's messages with `engine_process`."""
        return self._thread

    # ----------------------------------------------------------------- the API

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Runs one prompt to completion. Cancelling the awaiting task aborts the request.
        `session_id` makes it a turn of that chat session, `cache_salt` gives it a cache
        namespace (`EngineCore.make_request`)."""
        request = self.core.make_request(
            prompt, params, request_id, call="generate", session_id=session_id, cache_salt=cache_salt
        )
        return await self._result(self._open(request))

    async def beam_search(
        self,
        prompt: Prompt,
        params: BeamSearchParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> list[Beam]:
        """The `beam_width` best hypotheses, best first; cancelling the task aborts the search."""
        request = self.core.make_request(
            prompt, params, request_id, call="beam_search", session_id=session_id, cache_salt=cache_salt
        )
        return await self._result(self._open(request))

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """An async iterator of the tokens as they are made (n == 1). Bad input raises here, at
        the call; the request is submitted when iteration starts, and ends (aborted if still
        going) when the iterator is closed, garbage-collected or left by an exception."""
        request = self.core.make_request(
            prompt, params, request_id, call="stream", session_id=session_id, cache_salt=cache_salt
        )
        if request.params.n != 1:
            raise ValueError(f"stream takes n == 1, got n={request.params.n}")
        return self._stream(request)

    def abort(self, request_id: str) -> None:
        """Ends the request (finish_reason "abort"); its blocks are freed before the next step."""
        self.core.abort(request_id, wait=False)

    def close_session(self, session_id: str) -> None:
        """The chat session has no more turns (see `EngineCore.close_session`). Only queued,
        as `abort` is: the loop applies it before its next step schedules anything."""
        self.core.close_session(session_id, wait=False)

    def chat(self, system: str | list[int] | None = None) -> AsyncChatSession:
        return AsyncChatSession(self, system)

    def decode(self, ids: list[int]) -> str:
        return self.core.decode(ids)

    def metrics(self) -> dict:
        return self.core.metrics()

    def metrics_text(self) -> str:
        return self.core.metrics_text()

    def dashboard(self, namespaces: list[int] | None = None) -> dict:
        """The dashboard's view of the core: captured between its steps (`EngineCore.dashboard`;
        blocks for the step in flight), finished here (`radixkv.dashboard.cache_view`)."""
        return finish_view(self.core.dashboard(namespaces))

    def check_invariants(self) -> None:
        """As `Engine.check_invariants`; blocks the caller for at most the step in flight."""
        self.core.check_invariants()

    def num_running_seqs(self) -> int:
        """Sequences the core runs, as of its last step (no round trip to a core process)."""
        if self.engine_process:
            return self.core.running_seqs
        return self.core.scheduler.num_running_seqs

    def is_alive(self) -> bool:
        """False once the loop thread or the core process has died (or the engine is shut
        down): every request then fails at once, and a server answers 503 at `/health`."""
        alive = self.core.is_alive() if self.engine_process else self._thread.is_alive()
        return self._fatal is None and not self._stopping and alive

    def abort_all(self) -> None:
        """Aborts every request still going (queued; each caller gets its abort)."""
        for request_id in list(self._handles):
            self.core.abort(request_id, wait=False)

    async def shutdown(self) -> None:
        """Aborts every request still going, stops the loop thread and waits for it, then
        stops the tensor-parallel workers, if any."""
        self.abort_all()
        self._stopping = True
        if self.engine_process:
            await asyncio.to_thread(self.core.close)
            return
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self.core.close()

    # ----------------------------------------------------------- caller side

    def _open(self, request: Request, stream: bool = False) -> _Handle:
        if self._stopping or self._fatal is not None:
            raise EngineDeadError("the engine's loop is not running (shut down, or died)") from self._fatal
        handle = _Handle(request, asyncio.get_running_loop())
        if stream:
            handle.seq = request.seqs[0]
        self._handles[request.request_id] = handle
        try:
            if self.engine_process:
                self.core.submit([request], stream=stream)
            else:
                self.core.submit([request])
        except BaseException:
            del self._handles[request.request_id]
            raise
        if self._fatal is not None:  # the loop died after the check above, maybe before it saw us
            self._post(handle, RequestError(request.request_id, self._fatal))
        return handle

    def _close(self, handle: _Handle) -> None:
        self._handles.pop(handle.request.request_id, None)
        if not handle.done:
            self.core.abort(handle.request.request_id, wait=False)

    async def _result(self, handle: _Handle) -> Any:
        try:
            item = await handle.queue.get()
        finally:
            self._close(handle)
        if isinstance(item, BaseException):
            raise item
        return self.core.result_of(item)  # the texts are made here, in the caller's thread

    async def _stream(self, request: Request) -> AsyncIterator[StreamDelta]:
        handle = self._open(request, stream=True)
        sent = 0
        try:
            while True:
                item = await handle.queue.get()
                if isinstance(item, BaseException):
                    raise item
                deltas = self.core.stream_deltas(request, handle.seq, sent, item.end, item.finished)
                sent = item.end
                for delta in deltas:
                    yield delta
                if item.finished:
                    return
        finally:
            self._close(handle)

    # ------------------------------------------------------------ loop thread

    def _run(self) -> None:
        core, idle = self.core, 0
        try:
            while True:
                self._wake.wait()
                self._wake.clear()  # before looking for work: a submission after this wakes us
                while core.has_work():
                    idle = step_watching_stalls(core, idle)
                if self._stopping:
                    return
        except BaseException as exc:  # a bug outside a step's containment: fail every caller
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """The core is gone (its loop broke, or its process died): every caller gets a
        RequestError caused by `exc`, and later calls an EngineDeadError."""
        self._fatal = exc
        for handle in list(self._handles.values()):
            if not handle.done:
                handle.done = True
                self._post(handle, RequestError(handle.request.request_id, exc))

    def _dispatch(self, requests: list[Request]) -> None:
        """In the loop thread, under the step lock: posts each request's news to its caller,
        as token counts and finished requests; the caller's coroutine makes the text. A stream's
        last item is its finished `_Progress`, posted even with no new token (an abort), so that
        its last delta carries the finish reason; a failed stream gets its RequestError. The
        news of one call goes to each event loop in one callback (`_post_all`)."""
        posts: list[tuple[_Handle, Any]] = []
        try:
            for request in requests:
                handle = self._handles.get(request.request_id)
                finished = request.status is Status.FINISHED
                streamed = handle is not None and handle.seq is not None and request.error is None
                if streamed:
                    end = len(handle.seq.tokens) - handle.seq.num_prompt_tokens
                    if end > handle.published or finished:
                        handle.published = end
                        posts.append((handle, _Progress(end, finished)))
                if not finished:
                    continue
                try:
                    result: Any = self.core.take(request.request_id)
                except RequestError as exc:
                    result = exc
                if handle is not None:
                    handle.done = True
                    if not streamed:
                        posts.append((handle, result))
        finally:  # what is marked done is posted, even if a later request breaks the loop
            self._post_all(posts)

    def _post(self, handle: _Handle, item: Any) -> None:
        self._post_all([(handle, item)])

    def _post_all(self, posts: list[tuple[_Handle, Any]]) -> None:
        """Puts each item in its handle's queue, one thread-safe callback per event loop: a step
        wakes a loop once, however many of its streams it served."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Handle, Any]]] = {}
        for handle, item in posts:
            by_loop.setdefault(handle.loop, []).append((handle, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
                for handle, _ in items:
                    self.core.abort(handle.request.request_id, wait=False)


def _deliver(items: list[tuple[_Handle, Any]]) -> None:
    for handle, item in items:
        handle.queue.put_nowait(item)
