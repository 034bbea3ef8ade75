"""A tensor-parallel worker: ranks 1..N-1 of an engine, each in its own process.

A worker is started by rank 0's `ParallelRunner` and talks to it over one pipe. It joins the
group, loads the same model as rank 0 and keeps its shard; it may be asked for its KV budget
(`Profile`, whose profiling forward runs in step with rank 0's), and on `Allocate` builds its own
`ModelRunner` over a KV cache of the same blocks with its slice of the heads. Then, for every
step, it receives one message (the step's block copies and chunks), runs the same copies and the
same forward (joining rank 0's all-reduces) and answers `None`, or the error's text when its step
raised. Its logits are not needed, so its LM head is left out.

A worker ends when rank 0 sends `None`, and also when the pipe closes (rank 0 exited or was
killed; then at once, with `os._exit`), so it never outlives the engine. It ignores SIGINT: a
Ctrl-C in a terminal reaches every process of the foreground group, and stopping the workers is
rank 0's call.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from radixkv.config import EngineConfig
from radixkv.model.loader import LoadedModel
from radixkv.model.memory_profile import kv_cache_budget
from radixkv.model.runner import ModelRunner
from radixkv.model.tensor_parallel import load_whole, plan_shards, shard_model
from radixkv.model.tp_group import all_reducer, connect, rank_device
from radixkv.scheduler.chunk import SequenceChunk


class Allocate(NamedTuple):
    """Rank 0 to a worker, once: build the KV cache and its host tier (every rank has the same
    blocks)."""

    num_blocks: int
    block_size: int
    num_host_blocks: int


class Profile(NamedTuple):
    """Rank 0 to a worker, at most once, before `Allocate`: the KV budget of this rank's shard
    (`memory_profile.kv_cache_budget` with these keywords)."""

    limits: dict[str, Any]


TransferKind = Literal["copy_blocks", "offload", "load"]  # the ModelRunner method that moves blocks


class Step(NamedTuple):
    """Rank 0 to a worker, each step: run these block transfers in order, then this forward."""

    transfers: list[tuple[TransferKind, list[int], list[int]]]
    chunks: list[SequenceChunk]


class _NoLogits(nn.Module):
    """The LM head of a worker: only rank 0 samples, so workers compute no logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., :0]


def worker_main(rank: int, size: int, port: int, config: EngineConfig, conn: Connection) -> None:
    """The body of worker `rank` (the target of its process). Answers each message with None
    (done), the error's text, or the `Profile` result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        loaded = _load(rank, size, port, config)
    except BaseException:
        _answer(conn, traceback.format_exc())  # rank 0 raises it from its next start-up call
        return
    runner: ModelRunner | None = None
    try:
        while True:
            message = pickle.loads(conn.recv_bytes())
            if message is None:
                return
            if isinstance(message, Step):
                conn.send(_run(runner, message))
            elif isinstance(message, Allocate):
                runner = ModelRunner(loaded, message.num_blocks, message.block_size, message.num_host_blocks)
                conn.send(None)
            else:
                conn.send(kv_cache_budget(loaded, **message.limits))
    except (EOFError, OSError):  # rank 0 is gone: nothing to answer, nothing worth tearing down
        os._exit(0)  # (a collective left waiting on a device could stall a normal exit)
    except BaseException:
        _answer(conn, traceback.format_exc())


def _load(rank: int, size: int, port: int, config: EngineConfig) -> LoadedModel:
    """Joins the group and returns this rank's shard on its device (the hooks hold the group)."""
    device = rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores: a worker takes its share of torch's threads
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    group = connect(port, rank, size, device)
    loaded = load_whole(config, device)
    loaded = shard_model(loaded, plan_shards(loaded, size), rank, all_reducer(group))
    loaded.model.lm_head = _NoLogits()
    loaded.model.to(device)
    return loaded


def _run(runner: ModelRunner | None, step: Step) -> str | None:
    try:
        if runner is None:
            raise RuntimeError("a step before the KV cache was built")
        for kind, src, dst in step.transfers:
            getattr(runner, kind)(src, dst)
        runner.forward(step.chunks)
        if runner.device.type == "cuda":
            # Answer when the step is done, not when it is queued: a collective that never
            # completes must keep this answer from coming, so that rank 0's timeout sees it.
            torch.cuda.synchronize(runner.device)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _answer(conn: Connection, text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send(text)
