"""The thread that runs model forwards one after another, like a device stream.

With host/device overlap (`EngineConfig.overlap`) the engine hands each step's forward to this
thread and goes on preparing the next step while it runs. Jobs run in submission order, one at a
time, so whatever one step writes into the KV cache is there before the next reads it, exactly
as kernels queued on one CUDA stream. `submit` returns once the job has started: the worker
holds the interpreter lock only until its forward releases it (a torch op, a kernel launch
waiting, the bench's sleeping stub), and a job waiting for the lock behind the host's Python
would otherwise start up to `sys.getswitchinterval()` (5 ms) late.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

_STOP = object()
START_TIMEOUT_S = 60.0
"""How long `submit` waits for the worker to start a job once it has taken it (the jobs ahead of
it may take as long as they take): a worker that does not start one in a minute is stuck, and the
job fails rather than hang the step."""
ALIVE_CHECK_S = 1.0
"""How often `submit` looks whether the worker still lives and has taken the job, while the jobs
ahead of it run."""


class StepWorker:
    """Runs `submit`ted callables in order on one daemon thread; each returns a Future. On CUDA
    the thread works on `device` (its current device is per thread). `close` stops it after the
    jobs already queued."""

    def __init__(self, device: torch.device) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._device = device
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixkv-step-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any], prelude: Callable[[], None] | None = None) -> Future:
        """Queues `job`; returns once it has started. `prelude`, if any, runs on the worker just
        before the job is reported started: Python the job needs done before the host resumes
        (the host would hold the lock while it ran). An exception in either fails the Future.
        RuntimeError once the worker is closed."""
        if self._closed:
            raise RuntimeError("the step worker is closed")
        queued = _Queued(job, prelude)
        self._jobs.put(queued)
        # One event only: a wake-up of this thread at the take would contend with the prelude.
        while not queued.started.wait(ALIVE_CHECK_S):
            if not self._thread.is_alive():
                queued.future.set_exception(RuntimeError("the step worker is gone"))
                break
            taken = queued.taken_at
            if taken is not None and time.monotonic() - taken > START_TIMEOUT_S:
                queued.future.set_exception(RuntimeError("the step worker did not start the forward"))
                break
        return queued.future

    def drain(self) -> None:
        """Returns once every job submitted so far has ended (a no-op queued behind them)."""
        if not self._closed and self._thread.is_alive():
            self.submit(lambda: None).exception()

    def close(self) -> None:
        """Stops the thread once its queued jobs are done (idempotent)."""
        self._closed = True
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join()

    @torch.inference_mode()
    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            item.taken_at = time.monotonic()
            future = item.future
            try:
                if item.prelude is not None:
                    item.prelude()
                item.started.set()
                result = item.job()
            except BaseException as exc:  # the step's, not the thread's: the engine contains it
                item.started.set()
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)


class _Queued:
    """A submitted job, with what its submitter waits on: `started` (set by the worker once the
    prelude has run), `taken_at` (its `time.monotonic()` when the worker took the job)."""

    __slots__ = ("future", "job", "prelude", "started", "taken_at")

    def __init__(self, job: Callable[[], Any], prelude: Callable[[], None] | None) -> None:
        self.job, self.prelude = job, prelude
        self.future: Future = Future()
        self.started = threading.Event()
        self.taken_at: float | None = None
