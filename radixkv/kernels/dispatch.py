"""Compiled or interpreted, chosen per launch from the tensors' device.

Triton decides between compiling a kernel and interpreting it when `triton.jit` decorates it, from
TRITON_INTERPRET, for the whole process. radixkv builds each kernel both ways instead
(`DualKernel`) and picks at every launch: tensors on a CUDA device run the compiled kernel, tensors
on the CPU the interpreter. So a CPU engine and a GPU engine can live in one process, a CPU user
needs no setting, and nothing changes the environment at import. TRITON_INTERPRET=1, set before
radixkv is imported, still interprets every launch (the interpreter reads CUDA tensors through host
copies), as Triton's own switch does.

Interpreted launches over CPU tensors run on one thread of their own (`_ShallowStackThread` says
why: the interpreter's Python calls would otherwise map memory at every op at some caller depths).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

FORCE_INTERPRET: bool = triton.knobs.runtime.interpret
"""TRITON_INTERPRET=1 at import: every launch interpreted, whatever the device."""
_LAUNCH_LOCK = threading.Lock()


def interpreted(device: torch.device) -> bool:
    """Whether a launch over tensors on `device` runs in Triton's interpreter."""
    return FORCE_INTERPRET or device.type != "cuda"


class DualKernel:
    """A Triton kernel compiled for CUDA tensors and interpreted for CPU tensors (one source).

    `kernel.on(device)[grid](...)` launches the right one; the caller holds `launch_guard()`.
    """

    def __init__(self, fn: Callable[..., Any], do_not_specialize: tuple[str, ...] = ()) -> None:
        self.compiled = JITFunction(fn, do_not_specialize=list(do_not_specialize))
        self.interpreted = InterpretedFunction(fn)

    def on(self, device: torch.device) -> Any:
        if not interpreted(device):
            return self.compiled
        # CUDA tensors under TRITON_INTERPRET=1 stay on the caller's thread, and so on its stream
        return _FromShallowStack(self.interpreted) if device.type == "cpu" else self.interpreted


def dual_jit(*, do_not_specialize: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], DualKernel]:
    """Decorator: a `DualKernel` of the function, written as for `triton.jit`.

    Triton compiles a variant of a kernel per value class of each integer argument (1, a multiple of
    16, other). `do_not_specialize` names the arguments that change from step to step (token and
    item counts, the block table's width), so a step of a new size reuses the kernel compiled at
    start instead of stalling its requests for a compile."""
    return lambda fn: DualKernel(fn, do_not_specialize)


def launch_guard() -> threading.Lock:
    """Held around every kernel launch. The interpreter patches triton.language module-wide while a
    kernel runs, so two interpreted launches at once break each other ("Did you forget to add
    @triton.jit ?"), and so would a compile in another thread. Uncontended in a GPU-only process
    (about 0.1 us); a CUDA graph replay takes no lock."""
    return _LAUNCH_LOCK


class _FromShallowStack:
    """An interpreted kernel whose launches run on `_SHALLOW_STACK`'s thread: `kernel[grid](...)`."""

    def __init__(self, kernel: InterpretedFunction) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(_SHALLOW_STACK.run, self.kernel[grid])


class _ShallowStackThread:
    """Runs interpreted launches, one at a time, on a thread whose Python stack starts empty.

    Why: CPython 3.11 and 3.12 (and 3.13 before its fix of gh-142183) keep a thread's frames in
    16 KiB chunks and unmap a chunk as soon as its frames return, so a call that crosses a
    chunk's end maps a new one each time. The interpreter makes a few Python calls per op of a
    kernel; when the caller's stack happens to end near a chunk's end (a test under pytest's
    frames, a step under a server's), every op maps and unmaps a chunk: up to 75,000 page faults
    in one 8-step `generate` of a tiny model, measured here, where other depths had none. A
    thread's first chunk is never unmapped, and it was measured to hold every launch of these
    kernels (`tests/test_kernel_dispatch.py`), so from this thread no op crosses a chunk, whatever
    the caller's depth.

    The caller's grad and inference modes (per thread in torch) go with each launch; a forked
    child starts a thread of its own. Callers hold `launch_guard()`, so one launch at a time
    reaches `run` and only the first starts the thread. A caller interrupted while it waits (a
    KeyboardInterrupt) waits on for the launch to end before it raises, so that nothing it does
    next races the kernel over its tensors. The thread drops each launch as soon as it has run:
    an idle thread holds no tensor of a closed engine.
    """

    def __init__(self) -> None:
        self._pid: int | None = None
        self._calls: queue.SimpleQueue[tuple[Future, Callable[[], Any]]] | None = None

    def run(self, launch: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._pid != os.getpid():
            self._pid, self._calls = os.getpid(), queue.SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(self._calls,), name="radixkv-interpreter")
            thread.daemon = True  # idle between launches; nothing of its own to finish at exit
            thread.start()
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def call() -> Any:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return launch(*args, **kwargs)

        done: Future = Future()
        self._calls.put((done, call))
        try:
            return done.result()
        except BaseException:
            wait([done])  # returns at once when the launch itself raised
            raise
        finally:
            del done  # an exception's frames hold this frame, which would hold it: a cycle

    @staticmethod
    def _serve(calls: queue.SimpleQueue[tuple[Future, Callable[[], Any]]]) -> None:
        while True:
            done, call = calls.get()
            try:
                done.set_result(call())
            except BaseException as error:  # raised again in the caller, by `done.result()`
                done.set_exception(error)
            del done, call


_SHALLOW_STACK = _ShallowStackThread()
