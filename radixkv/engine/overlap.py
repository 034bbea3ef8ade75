"""Host/device overlap: the host schedules and prepares step N+1 while the device runs step N.

One overlapped `step()` (in the order it runs, under the step lock):
1. Queued submissions and aborts are applied.
2. Every sequence that step N (in flight on the `StepWorker`) will sample and that goes on gets a
   `PLACEHOLDER` token, and step N+1 is scheduled: those sequences decode their placeholder. A
   sequence that step N's token brings to `max_tokens` or `max_model_len` gets none; beam groups
   and a prompt about to fork into `n` samples get none either (step N's result reshapes them),
   nor does a structured sequence (its next token mask needs step N's token consumed by its
   grammar), so they skip step N+1.
3. Step N+1's inputs are built and sent (`ModelRunner.prepare`).
4. When the worker can resolve step N+1's placeholders itself (below), step N+1 is submitted now,
   queued behind step N.
5. Step N's logits are awaited, the placeholders taken off, and its tokens sampled
   (`Scheduler.sample_step`).
6. Otherwise step N+1's placeholders become those tokens in its inputs, its block copies run, and
   it is submitted to the worker.
7. Step N's tokens are appended, stops found, finished sequences cached and released
   (`Scheduler.commit`), while step N+1 runs.

Resolved on the worker, as SGLang's overlap scheduler resolves its future token ids on the device:
when every placeholder of step N+1 belongs to a greedy sequence whose logits nothing processes, and
step N+1 moves no blocks (and, for now, on the CPU only: see `_resolvable`), its token is the
argmax of its row of step N's logits, which the worker holds as soon as step N's forward ends.
The worker's job for step N+1 then starts by writing those argmaxes into its inputs, right after
step N's forward, with no wait for the host: the device goes from one step to the next without
the two thread hand-overs (the host waking at step N's result, the worker waking at step N+1's
submission) that sit between them otherwise. The host's sampling
of step N takes the same argmax of the same logits (`sample`'s greedy rows), so both agree. Any
other step (sampled rows, logits processors, block copies, loads) takes the host's path of step 6.

Correctness, as the engine without overlap:
- A sequence that stops on EOS or a stop string at step N was already scheduled in step N+1: its
  extra token is computed and discarded (its entry in N+1 finds its table gone and is skipped).
- Only computed KV is cached: while a step is in flight, each of its sequences counts the slots it
  reserved as `Sequence.ahead`, and finishing, aborting or preempting caches `num_computed`
  tokens only. Blocks released while a step is in flight can only be written by later device
  work, which the worker runs after it.
- A preempted sequence drops its in-flight token (its row is skipped, its generator untouched);
  resuming recomputes and samples it again, as without overlap.
- A forward that raises fails its step's requests (`RequestError`), and the step scheduled behind
  it runs with a harmless token in their places, its rows for them discarded: every other request
  goes on. Blocks are released exactly once, by the failure.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np
import torch

from radixkv.model.step_worker import StepWorker
from radixkv.sampling.sampler import greedy
from radixkv.scheduler.request import PLACEHOLDER, Request, Sequence, Status
from radixkv.scheduler.scheduled_seq import ScheduledSeq
from radixkv.scheduler.step_sampling import SampledStep

RESOLVED_IF_LOST = 0
"""The input token of a placeholder whose sequence's step failed: any vocabulary id serves, the
row it produces is discarded."""


class InFlight(NamedTuple):
    """A submitted step: its batch and the Future of its logits."""

    batch: list[ScheduledSeq]
    logits: Future


SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval an overlapped engine sets (Python's default is 5 ms,
`sys.setswitchinterval`). The host and the step worker hand the interpreter lock to each other
at every step: when a forward ends while the host runs Python, the worker waits for the lock
until the host blocks or the interval runs out. In `radixkv bench engine --case
overlap_decode_256` at 5 ms, one step gap in ten took 0.7 to 1.6 ms instead of 0.2, raising the
period to 1.15-1.35 x the device's time; at 0.5 ms the gaps stay under 0.35 ms. It is
process-wide: an engine only lowers it, never raises it back."""


class OverlapStepper:
    """The overlapped `EngineCore.step` (see the module docstring). `in_flight` is the step the
    worker runs, if any; `settle` waits for it and drops its tokens (the engine is closing)."""

    def __init__(self, core: Any) -> None:  # the EngineCore that owns it (which imports this module)
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.core = core
        self.worker = StepWorker(core.runner.device)
        self.in_flight: InFlight | None = None

    def step(self) -> list[Request]:
        core = self.core
        with core._lock:
            ended = core._drain()
            flight, self.in_flight = self.in_flight, None
            batch: list[ScheduledSeq] = []
            inputs: Any = None
            holes: list[tuple[int, ScheduledSeq]] = []
            speculated: list[Sequence] = []
            sampled: SampledStep | None = None
            touched: list[Request] = []
            try:
                try:
                    if flight is not None:
                        speculated = _speculate(flight.batch, core.max_model_len)
                    batch = self._schedule(ended, idle=flight is None)
                    for item in batch:
                        item.seq.ahead += len(item.token_ids)
                    prepare = getattr(core.runner, "prepare", None)
                    inputs = prepare(batch) if batch and prepare is not None else None
                    holes = _placeholders(batch)
                except Exception as exc:
                    ended += core._fail(core._step_requests(batch), exc)
                    batch = []
                early = bool(batch) and flight is not None and self._resolvable(inputs, holes)
                if early:
                    try:
                        self._submit_resolving(batch, inputs, holes, flight)
                    except Exception as exc:
                        ended += core._fail(core._step_requests(batch), exc)
                        batch, early = [], False
                if flight is not None:
                    sampled, lost = self._sample(flight, speculated)
                    ended += lost
                if early:
                    _fill_holes(holes, sampled)
                elif batch:
                    try:
                        self._submit(batch, inputs, holes, sampled)
                    except Exception as exc:
                        ended += core._fail(core._step_requests(batch), exc)
                if sampled is not None:
                    try:
                        touched, failed = core.scheduler.commit(sampled)
                    except Exception as exc:
                        ended += core._fail_each([(r, exc) for r in _requests(flight.batch)])
                    else:
                        ended += core._fail_each(failed)
            except BaseException as exc:  # contained as a failure of both steps, then re-raised
                self.settle()
                self.worker.drain()  # a step submitted but not yet tracked, or not yet sampled
                steps = (flight.batch if flight is not None else []) + batch
                core._notify(ended + core._fail_each([(r, exc) for r in _requests(steps)]))
                raise
            return core._end_step(touched, ended)

    def settle(self) -> None:
        """Waits for the step in flight, if any, and forgets its tokens; its KV counts as
        computed if it ran, and its requests fail if it raised."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return
        _computed(flight.batch)
        try:
            flight.logits.result()
        except Exception as exc:
            self.core._fail_each([(r, exc) for r in _requests(flight.batch)])

    def close(self) -> None:
        self.settle()
        self.worker.close()

    def _schedule(self, ended: list[Request], idle: bool) -> list[ScheduledSeq]:
        """The next batch; with no step in flight, waits for the KV store as `EngineCore.step`
        does (the requests aborted meanwhile join `ended`)."""
        core = self.core
        batch = core.scheduler.schedule()
        while idle and not batch and core.scheduler.waits_for_store:
            core.store.wait(core.STORE_POLL_S)
            ended += core._drain()
            batch = core.scheduler.schedule()
        return batch

    def _sample(
        self, flight: InFlight, speculated: list[Sequence]
    ) -> tuple[SampledStep | None, list[Request]]:
        """Step N's tokens, once its logits are in; on a failed forward, None and the requests
        failed with it."""
        _computed(flight.batch)
        for seq in speculated:
            if seq.tokens[-1] == PLACEHOLDER:
                seq.tokens.pop()
        try:
            logits = flight.logits.result()
        except Exception as exc:
            return None, self.core._fail_each([(r, exc) for r in _requests(flight.batch)])
        return self.core.scheduler.sample_step(flight.batch, logits), []

    def _resolvable(self, inputs: Any, holes: list[tuple[int, ScheduledSeq]]) -> bool:
        """Whether the worker can fill step N+1's placeholders from step N's logits (see the
        module docstring): built inputs on the CPU, no block transfer before the forward, and
        every placeholder a greedy sequence's whose logits nothing processes.

        Not on CUDA yet: the host samples step N on the stream the worker has queued step N+1
        on, so its `tolist()` would wait for step N+1 to end and the device would idle through
        the host's commit. That needs the host's sampling on a stream of its own, waiting for an
        event after step N's logits."""
        if inputs is None or inputs.input_ids.device.type != "cpu" or self.core.kv.transfers.pending:
            return False
        params = [item.request.params for _, item in holes]
        return all(p.greedy and not p.processes_logits for p in params)

    def _submit_resolving(
        self, batch: list[ScheduledSeq], inputs: Any, holes: list[tuple[int, ScheduledSeq]], flight: InFlight
    ) -> None:
        """Hands step N+1's forward to the worker before step N's tokens are sampled: the job
        first writes the argmax of each placeholder's row of step N's logits into its inputs."""
        core = self.core
        rows = _logit_rows(flight.batch)
        input_ids = inputs.input_ids
        where = np.array([index for index, _ in holes], dtype=np.int64)
        source = np.array([rows[id(item.seq)] for _, item in holes], dtype=np.int64)
        resolve = None
        if holes:
            resolve = functools.partial(_write_argmaxes, input_ids, where, flight.logits, source)
        core.num_steps += 1
        execute = functools.partial(core.runner.execute, inputs)
        self.in_flight = InFlight(batch, self.worker.submit(execute, resolve))

    def _submit(
        self,
        batch: list[ScheduledSeq],
        inputs: Any,
        holes: list[tuple[int, ScheduledSeq]],
        sampled: SampledStep | None,
    ) -> None:
        """Puts step N's tokens into step N+1's placeholders (`holes`: input index and entry),
        runs its block copies and hands its forward to the worker."""
        core = self.core
        values = _fill_holes(holes, sampled)
        if holes and inputs is not None:
            where = [index for index, _ in holes]
            input_ids = inputs.input_ids
            if input_ids.device.type == "cpu":  # numpy's indexing: a tenth of torch's 0.1 ms here
                input_ids.numpy()[0, where] = values
            else:
                ids = torch.tensor(values, dtype=input_ids.dtype).to(input_ids.device, non_blocking=True)
                input_ids[0, torch.tensor(where, device=input_ids.device)] = ids
        core.num_steps += 1
        core.kv.run_transfers(core.runner)
        run: Callable[[], torch.Tensor]
        if inputs is not None:
            run = functools.partial(core.runner.execute, inputs)
        else:
            run = functools.partial(core.runner.forward, batch)
        self.in_flight = InFlight(batch, self.worker.submit(run))


def _speculate(batch: list[ScheduledSeq], max_model_len: int) -> list[Sequence]:
    """Gives a placeholder to each sequence of the in-flight `batch` that it will sample and
    that goes on after that token (see the module docstring); returns them."""
    out = []
    for item in batch:
        seq, request = item.seq, item.request
        if item.logits != "last" or seq.table is None or request.is_beam_search:
            continue
        if seq.grammar is not None:  # its next mask needs this token consumed first
            continue
        params = request.params
        if params.n > 1 and not request.prompt_done:  # this token forks the prompt into samples
            continue
        length = len(seq.tokens) + 1
        if length - seq.num_prompt_tokens >= params.max_tokens or length >= max_model_len:
            continue
        seq.tokens.append(PLACEHOLDER)
        out.append(seq)
    return out


def _placeholders(batch: list[ScheduledSeq]) -> list[tuple[int, ScheduledSeq]]:
    """The entries of `batch` that decode a placeholder, with their index in the step's inputs."""
    holes, index = [], 0
    for item in batch:
        if item.token_ids[0] == PLACEHOLDER:
            holes.append((index, item))
        index += len(item.token_ids)
    return holes


def _fill_holes(holes: list[tuple[int, ScheduledSeq]], sampled: SampledStep | None) -> list[int]:
    """Step N's sampled tokens into the entries of step N+1 that decode a placeholder (a harmless
    one where a sequence's step failed or it was not sampled); returns them in `holes`' order."""
    tokens = dict(zip(sampled.seqs, sampled.tokens, strict=True)) if sampled is not None else {}
    values = []
    for _, item in holes:
        token = tokens.get(item.seq)
        item.token_ids[0] = token = RESOLVED_IF_LOST if token is None else token
        values.append(token)
    return values


def _logit_rows(batch: list[ScheduledSeq]) -> dict[int, int]:
    """By `id` of each sequence of `batch` that decodes one token (`logits == "last"`), its row
    of the step's logits: one row per such entry and one per token of an entry with all its
    logits, in batch order, as the runner returns them."""
    rows, row = {}, 0
    for item in batch:
        if item.logits == "last":
            rows[id(item.seq)] = row
            row += 1
        elif item.logits == "all":
            row += len(item.token_ids)
    return rows


def _write_argmaxes(input_ids: torch.Tensor, where: np.ndarray, logits: Future, source: np.ndarray) -> None:
    """On the worker: `input_ids[0, where[i]]` = the argmax of row `source[i]` of the finished
    step's `logits` (float32, as `sample` takes them), or a harmless token if that step failed
    (its requests fail with it, and their rows here are discarded). CPU tensors, indexed through
    numpy (a tenth of torch's indexing cost here)."""
    try:
        rows = logits.result().float()
    except Exception:
        input_ids.numpy()[0, where] = RESOLVED_IF_LOST
        return
    input_ids.numpy()[0, where] = greedy(torch.from_numpy(rows.numpy()[source])).numpy()


def _computed(batch: list[ScheduledSeq]) -> None:
    """The step's forward has ended: its slots no longer count as ahead."""
    for item in batch:
        item.seq.ahead -= len(item.token_ids)


def _requests(batch: list[ScheduledSeq]) -> list[Request]:
    """The batch's requests still going, each once."""
    unique = {id(item.request): item.request for item in batch}.values()
    return [r for r in unique if r.status is not Status.FINISHED]
