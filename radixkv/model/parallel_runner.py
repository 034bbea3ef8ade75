"""Rank 0 of a tensor-parallel engine: the runner the engine core steps, over N processes.

`ParallelRunner` has the interface of `ModelRunner` that the core uses (`forward(chunks)`,
`copy_blocks(src, dst)`, `device`) and hides the other ranks behind it. Building it checks
`tensor_parallel_size` against the model's plan and the devices (ValueError, before any process
starts), starts ranks 1..N-1 (`radixkv.model.tp_worker`), joins their group and shards rank 0's
own copy of the model (`radixkv.model.tensor_parallel`). The core then sizes the KV pool from the
rank's heads and calls `allocate`. Workers come from multiprocessing's fork server, started once
per process with torch, transformers and radixkv imported (about 10 s here); every later worker
is a fork of it (under a second), and, the server never having touched a device, CUDA works in
them as with spawn.

Each step is one message per worker, pickled once: the block transfers made since the last step
(copy-on-write copies and host-tier offloads and loads, run here at once, loads layer by layer
in the forward, and sent, in order, with the next forward) and the step's chunks, from which every rank
derives the same positions, slots and block tables. Rank 0 runs its shard meanwhile, the ranks
meet in the rowwise all-reduces, and rank 0 returns the full logits (its LM head is whole) after
every worker has answered. Every rank holds the same blocks over its own heads, so the radix
cache, eviction and copy-on-write on rank 0 need not know about the others.

Failures. A worker that dies (seen on its process sentinel and its pipe) or stops answering
(`COLLECTIVE_TIMEOUT`) is fatal: the runner stops every worker and raises `TensorParallelError`
from this and every later step, so the core fails the step's requests with a `RequestError` and
every later one likewise, without hanging. An error raised by every rank alike (a bad chunk,
caught before any collective) is the step's error alone and the ranks stay in step; an error on
some ranks only is fatal. Workers are stopped by `close()`, when the runner is collected, and at
interpreter exit; a worker also exits when rank 0's end of its pipe closes.

Scripts that build a tensor-parallel engine need the usual `if __name__ == "__main__":` guard,
since each worker imports the main module, as spawned processes do.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from radixkv.config import EngineConfig
from radixkv.errors import TensorParallelError
from radixkv.model.loader import LoadedModel
from radixkv.model.memory_profile import kv_cache_budget
from radixkv.model.runner import ModelRunner
from radixkv.model.tensor_parallel import load_whole, plan_shards, shard_model
from radixkv.model.tp_group import (
    COLLECTIVE_TIMEOUT,
    Communicator,
    all_reducer,
    check_devices,
    connect,
    open_store,
    rank_device,
)
from radixkv.model.tp_worker import Allocate, Profile, Step, TransferKind, worker_main
from radixkv.scheduler.chunk import SequenceChunk

STARTUP_TIMEOUT_S = 600.0  # a worker loads the whole checkpoint before it answers
ERROR_GRACE_S = 5.0  # how long workers get to report the error rank 0 hit before it is fatal
STOP_GRACE_S = 5.0  # how long a worker gets to exit on its own before it is terminated


@dataclass(eq=False)
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection


class ParallelRunner:
    """`ParallelRunner(config)` starts `config.tensor_parallel_size - 1` workers; `model` is rank
    0's shard. Call `allocate(num_blocks, block_size)` before the first step."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        check_devices(config.device, size)
        self.size = size
        self.device = rank_device(config.device, 0)
        full = load_whole(config, self.device)
        specs = plan_shards(full, size)  # every size check, before any process starts
        self.local: ModelRunner | None = None
        self._transfers: list[tuple[TransferKind, list[int], list[int]]] = []  # for the next Step
        self._dead: TensorParallelError | None = None
        self._workers: list[_Worker] = []
        self._group: Communicator | None = None
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        self._store = open_store(size)  # kept: the group's rendezvous lives on rank 0
        context = mp.get_context("forkserver")
        context.set_forkserver_preload([worker_main.__module__])
        try:
            for rank in range(1, size):
                parent, child = context.Pipe()
                args = (rank, size, self._store.port, config, child)
                name = f"radixkv-tp{rank}"
                process = context.Process(target=worker_main, args=args, name=name, daemon=True)
                process.start()
                child.close()
                self._workers.append(_Worker(rank, process, parent))
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._group = connect(self._store, 0, size, self.device)  # returns once every worker has joined
            self.model: LoadedModel = shard_model(full, specs, 0, all_reducer(self._group))
            self.model.model.to(self.device)
        except BaseException as error:
            dead = [worker for worker in self._workers if not worker.process.is_alive()]
            self.close()
            if dead and isinstance(error, Exception):
                raise RuntimeError(
                    f"{_death(dead[0])} while the group was forming (its traceback is above; a script "
                    'that builds a tensor-parallel engine needs the `if __name__ == "__main__":` guard)'
                ) from error
            raise

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1, in rank order."""
        return [worker.process.pid for worker in self._workers]

    @property
    def num_blocks(self) -> int:
        return self._runner().num_blocks

    @property
    def block_size(self) -> int:
        return self._runner().block_size

    def kv_cache_budget(self, loaded: LoadedModel, **limits: Any) -> int:
        """`memory_profile.kv_cache_budget` of every rank's shard, measured on all ranks at once
        (on CUDA its profiling forward all-reduces like any step), and the smallest: every rank
        holds the same blocks. `loaded` is rank 0's shard; `limits` are the function's keywords."""
        own = partial(kv_cache_budget, loaded, **limits)
        return min(self._on_every_rank(Profile(limits), own, "profile memory"))

    def allocate(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        """Builds every rank's KV cache (`num_blocks` blocks over the rank's heads, and a host tier
        of `num_host_blocks`) and waits until every worker is ready. Raises RuntimeError with a
        worker's traceback if it failed."""

        def build() -> None:
            self.local = ModelRunner(self.model, num_blocks, block_size, num_host_blocks)

        self._on_every_rank(Allocate(num_blocks, block_size, num_host_blocks), build, "build its KV cache")

    def forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """`ModelRunner.forward` over all ranks: float32 logits `[rows, vocab]` from rank 0."""
        local = self._runner()
        # Plain chunks for the other ranks: a subclass (the scheduler's ScheduledSeq) carries its
        # request, which stays here.
        plain = [
            SequenceChunk(c.token_ids, c.start_pos, c.block_table, c.logits, c.group_tables) for c in chunks
        ]
        self._send(pickle.dumps(Step(self._transfers, plain)))
        self._transfers = []
        try:
            deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
            try:
                logits, error = local.forward(chunks), None
                if not device_done(self.device, deadline):
                    self._fail(f"rank 0's step did not finish within {COLLECTIVE_TIMEOUT.seconds} s")
            except TensorParallelError:
                raise
            except Exception as raised:
                logits, error = None, raised
            wait_s = ERROR_GRACE_S if error else max(0.0, deadline - time.monotonic())
            answers = self._collect("run a step", wait_s)
        except BaseException:
            if self._dead is None:  # interrupted (KeyboardInterrupt) mid-step: the ranks are out of step
                self._stop_all("rank 0 was interrupted during a step")
            raise
        failed = [(rank, text) for rank, text in answers if text is not None]
        if error is None and not failed:
            return logits
        own = f"{type(error).__name__}: {error}" if error is not None else None
        if error is not None and all(text == own for _, text in failed) and len(failed) == len(answers):
            raise error  # every rank refused the same step before any collective: still in step
        where = ", ".join(f"rank {rank}: {text}" for rank, text in failed) or "the workers succeeded"
        self._fail(f"the ranks diverged in a step (rank 0: {own or 'succeeded'}; {where})", error)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copies device blocks (copy-on-write) on rank 0 now and on the workers before their
        next forward, in order with the other transfers."""
        self._transfer("copy_blocks", src, dst)

    def offload(self, src: list[int], dst: list[int]) -> None:
        """Device blocks to the host tier: each rank moves its own heads (see `copy_blocks`)."""
        self._transfer("offload", src, dst)

    def load(self, src: list[int], dst: list[int]) -> None:
        """Host-tier blocks back to the device: each rank its own heads (see `copy_blocks`)."""
        self._transfer("load", src, dst)

    def close(self) -> None:
        """Stops every worker and frees rank 0's KV cache and the group's rendezvous store
        (idempotent). Later steps raise TensorParallelError."""
        if self._dead is None:
            self._dead = TensorParallelError("the tensor-parallel engine is closed")
        self._finalizer()
        if self.local is not None:
            self.local.close()
        self._group = self._store = None  # their sockets close with the last reference

    # ---------------------------------------------------------------- internals

    def _transfer(self, kind: TransferKind, src: list[int], dst: list[int]) -> None:
        """Runs a transfer here and queues it for the workers. A lost or closed group skips it
        without refusing (a closed one has freed rank 0's cache): the step's forward raises
        TensorParallelError instead, so the core fails the step the usual way rather than in the
        middle of its transfers."""
        if self.local is None:
            raise RuntimeError("ParallelRunner.allocate must run before the first step")
        if self._dead is not None:
            return
        getattr(self.local, kind)(src, dst)
        self._transfers.append((kind, list(src), list(dst)))

    def _on_every_rank(self, message: Allocate | Profile, own: Callable[[], Any], what: str) -> list[Any]:
        """Sends a start-up `message`, runs `own()` here meanwhile, and returns every rank's
        result (rank 0's first). Any failure stops the workers: a worker's is a RuntimeError
        with its traceback; the first answer waits for the workers to load the model."""
        try:
            self._send(pickle.dumps(message))
            result = own()
            answers = self._collect(what, STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        failed = [(rank, answer) for rank, answer in answers if isinstance(answer, str)]
        if failed:
            self.close()
            rank, text = failed[0]
            raise RuntimeError(f"tensor-parallel worker rank {rank} failed to {what}:\n{text}")
        return [result, *(answer for _, answer in answers)]

    def _runner(self) -> ModelRunner:
        if self._dead is not None:
            raise TensorParallelError(str(self._dead)) from self._dead.__cause__
        if self.local is None:
            raise RuntimeError("ParallelRunner.allocate must run before the first step")
        return self.local

    def _send(self, message: bytes) -> None:
        for worker in self._workers:
            try:
                worker.conn.send_bytes(message)
            except OSError:
                self._fail(_death(worker))

    def _collect(self, what: str, timeout: float) -> list[tuple[int, Any]]:
        """Every worker's answer, in rank order: None (done), a str (an error) or a result. A
        worker that dies or does not answer within `timeout` seconds is fatal (`_fail`)."""
        answers: dict[int, Any] = {}
        pending = {worker.conn: worker for worker in self._workers}
        deadline = time.monotonic() + timeout
        while pending:
            sentinels = {worker.process.sentinel: worker for worker in pending.values()}
            ready = wait([*pending, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = ", ".join(str(worker.rank) for worker in pending.values())
                self._fail(f"tensor-parallel worker rank {ranks} did not {what} within {timeout:.0f} s")
            for handle in ready:
                worker = pending.get(handle) or sentinels.get(handle)
                if worker is None or worker.conn not in pending:  # answered and exited: read once
                    continue
                try:
                    if handle is worker.conn or worker.conn.poll():
                        answers[worker.rank] = worker.conn.recv()
                        del pending[worker.conn]
                        continue
                except (EOFError, OSError):
                    pass
                self._fail(_death(worker))
        return sorted(answers.items())

    def _fail(self, reason: str, cause: BaseException | None = None) -> None:
        """Stops every worker and makes this and every later step raise TensorParallelError."""
        self._stop_all(reason)
        raise self._dead from cause

    def _stop_all(self, reason: str) -> None:
        self._dead = TensorParallelError(f"{reason}; the tensor-parallel workers are stopped")
        if self.device.type == "cuda" and self._group is not None:
            # NCCL waits on the device, not the host: a collective whose peer is gone would stall
            # rank 0's stream for good. Aborting the communicator ends it.
            with contextlib.suppress(RuntimeError):
                self._group.abort()
        self._finalizer()


def device_done(device: torch.device, deadline: float, poll_s: float = 0.001) -> bool:
    """Waits until the work queued so far on `device`'s current stream has run; False if it has
    not by `deadline` (`time.monotonic()`). A host-only device is always done. On CUDA the step's
    kernels are queued, not run, when `forward` returns, and a stuck collective would otherwise
    surface later, in a blocking read of the logits with no deadline."""
    if device.type != "cuda":
        return True
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def _death(worker: _Worker) -> str:
    process = worker.process
    process.join(timeout=1.0)
    code = process.exitcode
    if code is None:
        return f"tensor-parallel worker rank {worker.rank} closed its pipe"
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"tensor-parallel worker rank {worker.rank} died ({how})"


def _stop(workers: list[_Worker]) -> None:
    """Asks every worker to exit, then terminates and kills those that do not in time."""
    for worker in workers:
        with contextlib.suppress(OSError, ValueError):
            worker.conn.send_bytes(pickle.dumps(None))
    deadline = time.monotonic() + STOP_GRACE_S
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join(timeout=1.0)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()
