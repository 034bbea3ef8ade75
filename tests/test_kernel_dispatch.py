"""Kernels choose compiled or interpreted per launch from the tensors' device; plans are shareable."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import threading
import time
import weakref

import pytest
import torch

from radixkv.interpreter import python_argv
from radixkv.kernels import copy_blocks, paged_attention, plan_paged_attention, store_kv
from radixkv.kernels.dispatch import _SHALLOW_STACK, interpreted
from radixkv.kernels.reference import paged_attention_ref


def test_cpu_tensors_are_interpreted_and_cuda_tensors_compiled():
    assert interpreted(torch.device("cpu"))
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not interpreted(torch.device("cuda", 0))


def test_importing_the_kernels_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, radixkv.kernels; print(os.environ.get('TRITON_INTERPRET'))"
    result = subprocess.run(python_argv("-c", code), env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_launches_planned_once_serve_every_layer():
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(12, 4, 2, 16, generator=generator) for _ in range(4)]
    block_table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 6], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 6], dtype=torch.int32)
    q = torch.randn(6, 4, 16, generator=generator)
    launches = plan_paged_attention(
        query_start_loc,
        seq_lens,
        block_table,
        num_tokens=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
    )
    for k_cache, v_cache in (caches[:2], caches[2:]):
        args = (q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
        torch.testing.assert_close(paged_attention(*args, launches=launches), paged_attention_ref(*args))
    with pytest.raises(ValueError, match="planned for 4 heads"):
        paged_attention(
            q[:, :2], caches[0], caches[1], block_table, seq_lens, query_start_loc, launches=launches
        )


def test_an_index_tensor_with_gaps_is_refused():
    k_cache, v_cache = torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16)
    ids = torch.tensor([[1, 5], [2, 6]]).t()  # rows of a transposed tensor: stride 2
    with pytest.raises(ValueError, match="src must be contiguous"):
        copy_blocks(k_cache, v_cache, ids[0], torch.tensor([3, 4]))


def _at_depth(depth: int, call):
    return call() if depth == 0 else _at_depth(depth - 1, call)


def test_an_interpreted_launch_maps_no_stack_chunk_per_op_from_any_caller_depth():
    """CPython before 3.13's fix of gh-142183 unmaps a chunk of a thread's frame stack whenever the
    frames in it return. The interpreter makes Python calls at every op of a kernel, so a launch
    from a caller whose stack ends near a chunk's end mapped and unmapped a chunk per op: thousands
    of page faults a launch at some depths. Launches run on a thread of their own, so at every
    depth of the caller (one 16 KiB chunk's worth of frames, and more) a launch takes few."""
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(12, 4, 2, 16, generator=generator) for _ in range(2))
    block_table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    args = (
        torch.randn(6, 4, 16, generator=generator),
        k_cache,
        v_cache,
        block_table,
        torch.tensor([13, 6], dtype=torch.int32),
        torch.tensor([0, 1, 6], dtype=torch.int32),
    )
    expected = paged_attention_ref(*args)
    paged_attention(*args)  # the first launch in a process starts the thread
    faults = {}
    for depth in range(0, 240, 3):
        counts = []
        for _ in range(2):  # the fewer of two: a thrash repeats at its depth, another thread's faults not
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            out = _at_depth(depth, lambda: paged_attention(*args))
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            torch.testing.assert_close(out, expected)
        faults[depth] = min(counts)
    worst = max(faults, key=faults.get)
    assert faults[worst] < 150, f"{faults[worst]} page faults in a launch from depth {worst}"


def test_the_launching_thread_keeps_no_tensor_of_a_finished_launch():
    """A closed engine's KV cache is freed by close(), not by the next launch: the idle thread
    holds nothing of the last one, neither after a launch that ran nor after one that raised."""
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    store_kv(torch.ones(3, 2, 16), torch.ones(3, 2, 16), k_cache, v_cache, torch.tensor([0, 1, 2]))
    assert k_cache[0, :3].eq(1).all()
    cache = weakref.ref(k_cache)
    del k_cache, v_cache
    assert cache() is None, "the launching thread still holds the last launch's cache"

    def failing(tensor: torch.Tensor) -> None:
        raise RuntimeError(f"launch over {tuple(tensor.shape)} failed")

    tensor = torch.zeros(8)
    with pytest.raises(RuntimeError, match=r"launch over \(8,\) failed"):
        _SHALLOW_STACK.run(failing, tensor)
    held = weakref.ref(tensor)
    del tensor
    assert held() is None, "the launching thread still holds a failed launch's tensor"


class Interrupted(Exception):
    pass


def test_an_interrupted_caller_raises_only_after_its_launch_ends():
    """A signal's exception in a waiting caller (Ctrl-C) is raised once the launch has ended, so that
    what the caller does next cannot race the kernel over its tensors."""
    started, interrupted, release, finished = (threading.Event() for _ in range(4))

    def launch() -> None:
        started.set()
        release.wait(60)
        finished.set()

    def on_signal(signum, frame) -> None:
        interrupted.set()
        raise Interrupted

    def interrupt() -> None:
        started.wait(60)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        interrupted.wait(60)  # the caller has the exception in hand; only now may the launch end
        release.set()

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(Interrupted):
            _SHALLOW_STACK.run(launch)
        assert finished.is_set(), "the caller raised while its launch still ran"
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_forked_child_launches_on_a_thread_of_its_own():
    """The launching thread does not survive a fork: the child starts its own instead of queueing
    launches for a thread that is not there."""
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    k, v = torch.ones(3, 2, 16), torch.ones(3, 2, 16)
    store_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 2]))  # the parent's thread is up
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only after a launch that wrote what it must
        try:
            store_kv(k, v, k_cache, v_cache, torch.tensor([5, 6, 7]))
            os._exit(0 if k_cache[1, 1:].eq(1).all() and k_cache[1, 0].eq(0).all() else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 60
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's launch never returned")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status[1]) == 0
