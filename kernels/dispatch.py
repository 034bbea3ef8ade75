"""Compiled or interpreted, chosen per launch from the tensors' device.

Triton decides between compiling a kernel and interpreting it when `triton.jit` decorates it, from
TRITON_INTERPRET, for the whole process. radixkv builds each kernel both ways instead
(`DualKernel`) and picks at every launch: tensors on a CUDA device run the compiled kernel, tensors
on the CPU the interpreter. So a CPU engine and a GPU engine can live in one process, a CPU user
needs no setting, and nothing changes the environment at import. TRITON_INTERPRET=1, set before
radixkv is imported, still interprets every launch (the interpreter reads CUDA tensors through host
copies), as Triton's own switch does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
        return self.interpreted if interpreted(device) else self.compiled


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
