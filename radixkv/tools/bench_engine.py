"""`radixkv bench engine`: the host's work per engine step, with the model's forward stubbed out.

On a GPU a decode step of a small model takes a few milliseconds, and the host must have the next
step ready by then. This measures everything but the model: the scheduler (admission, growth,
the waiting queue), the KV books (allocation, the radix tree), the step's inputs (block tables,
positions, slot mappings, their copy to the device) and postprocessing (sampling, appending,
caching). The transformers model inside the `ModelRunner` is replaced by `StubModel`, which
returns logits of the right shape at once, so every other line of a step runs as it does in
production and the figures are host time only.

Cases (tiny-llama's shapes, bfloat16 KV, block size 16, random prompt tokens, greedy, EOS ignored):
- `decode_256`: 256 sequences decoding at 2,048 tokens of context.
- `mixed_prefill`: 128 decodes beside a chunked prefill of 8,000-token prompts (2,048-token budget:
  1,920 prompt tokens a step).
- `waiting_64`, `waiting_256`, `waiting_512`: 64 sequences decode and fill every slot
  (`max_num_seqs` 64) while that many prompts wait; prompts share 1,024-token prefixes in 8 groups.
  Admission can take nothing, so a step should cost the same whatever the queue's length.
- `overlap_decode_256`: `decode_256` with a stub that keeps a simulated device busy for
  `OVERLAP_DEVICE_MS` a step (a sleep on the step worker, the interpreter lock released), run with
  host/device overlap and without, round by round in turns: `host_ms` is one step's host work (the
  serial period less the device's time there), `device_ms` the stub's busy time a step in the
  overlapped run, `period_ms` the overlapped period between steps; `serial_period_ms` and
  `serial_device_ms` the same of the serial run (its period about host + device). Wall clock,
  whatever `--clock` says: the device's time is a wait. A sleep lasts longer than it asks when the
  cores are busy, and longer for the host's thread than for the mostly idle worker (the OS runs
  the thread that used less CPU first), so each side's device time is its own measure.
Each case is set up with untimed steps, warmed up, then timed in `ROUNDS` rounds of `--steps` steps;
the report gives the fastest round's mean milliseconds per step and per part.

The clock (`--clock`) is by default the stepping thread's CPU time (`time.thread_time`): the stub
makes a step pure host work that never waits, so on a dedicated machine CPU and wall time agree,
while on a shared one wall time also counts the slices the OS gives other processes. On this 2-core
machine shared by four processes, a round of 20 decode_256 steps (20 ms) was never free of them:
descheduled slices of 4-5 ms in random parts raised the wall figure by up to half. `--clock wall`
measures wall time. A case's pool has
room for every step it runs, so it stays what it says: no sequence is preempted. torch runs on one
intra-op thread while it measures: the host's step is one thread's work, and on a shared 2-core
machine a second torch thread made small CPU ops (a 256 x 259 argmax) up to 30 times slower.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixkv.config import EngineConfig
from radixkv.model.presets import PRESETS
from radixkv.model.runner import kv_block_bytes
from radixkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixkv.engine.sync_engine import Engine

PARTS = ("schedule", "block_transfers", "prepare_inputs", "forward_stub", "postprocess", "other")
"""Where a step's host time goes: `prepare_inputs` is `ModelRunner.forward` less the stub's call;
`other` is what `Engine.step` does outside the timed calls (queues, metrics, hooks)."""
WARMUP_STEPS = 3
ROUNDS = 3
"""Rounds of timed steps per case; the report keeps the fastest, the one other processes on a
shared machine disturbed least (as timeit's minimum)."""
BLOCK_SIZE = 16
OVERLAP_DEVICE_MS = 2.0
"""The stub device's busy time a step in `overlap_decode_256`: about the host's work for the case
on this 2-core machine (0.9 ms unloaded, up to 3 ms when shared), so that neither side hides the
other by far and the period shows whether they overlap."""


@dataclass(slots=True)
class CaseResult:
    """One case: mean host milliseconds per step, and per part (`PARTS`)."""

    name: str
    host_ms_per_step: float
    steps: int
    parts: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class OverlapResult:
    """`overlap_decode_256`, in milliseconds a step (see the module docstring)."""

    name: str
    host_ms: float
    device_ms: float
    period_ms: float
    serial_period_ms: float
    serial_device_ms: float
    steps: int


CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


class StubModel(torch.nn.Module):
    """Stands in for the transformers model: one row of logits per entry of `logits_to_keep`.

    The logits are a fixed random tensor sliced to the step's rows (so greedy picks the same token
    for every row, which no case depends on); the time spent inside is recorded for the report,
    by `clock`. `busy_s` > 0 sleeps that long in each call, standing in for a device's time.
    """

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device, busy_s: float = 0.0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.randn((1, max_rows, vocab_size), generator=generator).to(device)
        self.busy_s = busy_s
        self.seconds = 0.0
        self.calls = 0
        self.clock: Callable[[], float] = time.perf_counter

    def forward(self, *, logits_to_keep: torch.Tensor, **_: Any) -> Any:
        start = self.clock()
        if self.busy_s:
            time.sleep(self.busy_s)  # a simulated device: busy, with the interpreter lock released
        out = _Output(self.logits[:, : logits_to_keep.shape[0]])
        self.seconds += self.clock() - start
        self.calls += 1
        return out


@dataclass(slots=True)
class _Output:
    logits: torch.Tensor


class _Timer:
    """Accumulated seconds, by `clock`, of calls to methods wrapped on an instance (`wrap`)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = dict.fromkeys(PARTS, 0.0)

    def wrap(self, owner: object, method: str, part: str) -> None:
        inner: Callable[..., Any] = getattr(owner, method)
        clock = self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += clock() - start

        setattr(owner, method, timed)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)


def stub_engine(config: EngineConfig, max_rows: int, busy_s: float = 0.0) -> tuple[Engine, StubModel]:
    """An engine whose model forward is a `StubModel` (the KV cache is allocated but never read)."""
    from radixkv.engine.sync_engine import Engine  # here, so that `radixkv --help` does not load torch

    engine = Engine(config)
    stub = StubModel(engine.model.vocab_size, max_rows, engine.runner.device, busy_s)
    engine.runner.model = stub
    return engine, stub


def _prompts(
    rng: random.Random, count: int, length: int, shared: list[list[int]] | None = None
) -> list[list[int]]:
    """`count` random prompts of `length` tokens; with `shared`, prompt i starts with shared[i % len]."""
    prompts = []
    for i in range(count):
        head = shared[i % len(shared)] if shared else []
        prompts.append(head + [rng.randrange(256) for _ in range(length - len(head))])
    return prompts


def stub_config(
    max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int, overlap: bool = False
) -> EngineConfig:
    """tiny-llama with room for `num_blocks` blocks of 16 tokens in bfloat16 (half float32's memory;
    the stub never reads the cache)."""
    model = PRESETS["tiny-llama"]()
    per_block = kv_block_bytes(
        model.num_hidden_layers, BLOCK_SIZE, model.num_key_value_heads, model.head_dim, torch.bfloat16
    )
    return EngineConfig(
        model="tiny-llama",
        dtype="bfloat16",
        device="cpu",
        block_size=BLOCK_SIZE,
        kv_cache_memory=num_blocks * per_block,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        overlap=overlap,
    )


def _blocks_per_seq(context: int, steps: int) -> int:
    """Blocks one sequence holds after `steps` decode steps from `context` tokens, one spare."""
    return -(-(context + steps) // BLOCK_SIZE) + 1


def _decode_256(
    rng: random.Random, steps: int, overlap: bool = False, busy_s: float = 0.0
) -> tuple[Engine, StubModel]:
    config = stub_config(256, 256 * 2048, 256 * _blocks_per_seq(2048, steps) + 64, overlap)
    engine, stub = stub_engine(config, 256, busy_s)
    params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
    for prompt in _prompts(rng, 256, 2047):
        engine.add_request(prompt, params)
    engine.step()  # every prompt prefilled in one step; each sequence now holds 2,048 tokens
    return engine, stub


def _mixed_prefill(rng: random.Random, steps: int) -> tuple[Engine, StubModel]:
    engine, stub = stub_engine(stub_config(140, 2048, 128 * _blocks_per_seq(1100, steps) + 10 * 520), 2048)
    params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
    for prompt in _prompts(rng, 128, 1000):
        engine.add_request(prompt, params)
    while len(engine.scheduler.waiting) or not all(r.prompt_done for r in engine.scheduler.running):
        engine.step()
    for prompt in _prompts(rng, 10, 8000):
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return engine, stub


def _waiting(num_waiting: int) -> Callable[[random.Random, int], tuple[Engine, StubModel]]:
    def setup(rng: random.Random, steps: int) -> tuple[Engine, StubModel]:
        engine, stub = stub_engine(stub_config(64, 64 * 2048, 64 * _blocks_per_seq(2048, steps) + 64), 64)
        params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
        shared = _prompts(rng, 8, 1024)
        for prompt in _prompts(rng, 64, 2047, shared):
            engine.add_request(prompt, params)
        engine.step()
        for prompt in _prompts(rng, num_waiting, 2048, shared):
            engine.add_request(prompt, params)
        return engine, stub

    return setup


CASES: dict[str, Callable[[random.Random, int], tuple[Engine, StubModel]]] = {
    # name -> setup(rng, steps): the engine and its stub, with room for `steps` more steps
    "decode_256": _decode_256,
    "mixed_prefill": _mixed_prefill,
    "waiting_64": _waiting(64),
    "waiting_256": _waiting(256),
    "waiting_512": _waiting(512),
}
OVERLAP_CASES = ("overlap_decode_256",)
"""Cases that report `OverlapResult`s (`run_overlap_case`)."""
OVERLAP_ROUNDS = 7
"""Rounds per side of `overlap_decode_256`: its figures are wall time, and every thread wake-up
(the worker's at a job, the host's at its result) waits for a free core, which on a loaded shared
machine takes milliseconds; more rounds find quieter moments."""


def run_overlap_case(name: str, steps: int) -> OverlapResult:
    """`overlap_decode_256`: the same engine and stub device with overlap off and on, warmed up,
    then `OVERLAP_ROUNDS` rounds of `steps` steps each in turns; keeps each side's fastest round."""
    total = WARMUP_STEPS + OVERLAP_ROUNDS * steps + 2  # the overlapped engine runs a step ahead
    busy_s = OVERLAP_DEVICE_MS / 1e3
    sides = {overlap: _decode_256(random.Random(0), total, overlap, busy_s) for overlap in (False, True)}
    for engine, _ in sides.values():
        for _ in range(WARMUP_STEPS):
            engine.step()
    best = {False: (float("inf"), 0.0), True: (float("inf"), 0.0)}  # (period, device) in seconds
    for _ in range(OVERLAP_ROUNDS):
        for overlap, (engine, stub) in sides.items():
            stub.seconds, stub.calls = 0.0, 0
            before = engine.num_steps
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            period = (time.perf_counter() - start) / steps
            if engine.num_steps - before != steps:
                idle = steps - engine.num_steps + before
                raise RuntimeError(f"bench case {name}: {idle} steps ran no batch")
            # Per call: the overlapped round's last forward may still be running when it ends.
            best[overlap] = min(best[overlap], (period, stub.seconds / max(stub.calls, 1)))
    for engine, _ in sides.values():
        engine.close()
    del sides
    gc.collect()
    (serial, serial_device), (period, device) = best[False], best[True]
    ms = 1e3
    return OverlapResult(
        name, (serial - serial_device) * ms, device * ms, period * ms, serial * ms, serial_device * ms, steps
    )


def run_case(name: str, steps: int, clock: str = "cpu") -> CaseResult:
    """Set up case `name`, warm up, then time `ROUNDS` rounds of `steps` steps by `clock` (a key
    of `CLOCKS`) and keep the fastest round; every step must run a batch."""
    engine, stub = CASES[name](random.Random(0), WARMUP_STEPS + ROUNDS * steps)
    now = stub.clock = CLOCKS[clock]
    timer = _Timer(now)
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.kv, "run_transfers", "block_transfers")
    timer.wrap(engine.runner, "forward", "prepare_inputs")
    timer.wrap(engine.scheduler, "postprocess", "postprocess")
    for _ in range(WARMUP_STEPS):
        engine.step()
    best: dict[str, float] | None = None
    for _ in range(ROUNDS):
        timer.reset()
        stub.seconds = 0.0
        before = engine.num_steps
        total = 0.0
        for _ in range(steps):
            start = now()
            engine.step()
            total += now() - start
        if engine.num_steps - before != steps:
            raise RuntimeError(f"bench case {name}: {steps - engine.num_steps + before} steps ran no batch")
        parts = dict(timer.seconds)
        parts["prepare_inputs"] -= stub.seconds
        parts["forward_stub"] = stub.seconds
        parts["other"] = total - sum(v for k, v in parts.items() if k != "other")
        if best is None or total < sum(best.values()):
            best = parts
    del engine, stub
    gc.collect()
    total = sum(best.values())
    return CaseResult(name, total * 1e3 / steps, steps, {k: v * 1e3 / steps for k, v in best.items()})


def run(args: argparse.Namespace) -> int:
    names = args.case or [*CASES, *OVERLAP_CASES]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the module docstring
    try:
        results = _run_cases(names, args)
    finally:
        torch.set_num_threads(threads)
    if args.json:
        print(json.dumps({"clock": args.clock, "cases": [asdict(r) for r in results]}, indent=2))
    return 0


def _run_cases(names: list[str], args: argparse.Namespace) -> list[CaseResult | OverlapResult]:
    results: list[CaseResult | OverlapResult] = []
    plain = [n for n in names if n not in OVERLAP_CASES]
    if plain:
        results += _run_plain_cases(plain, args)
    for name in names:
        if name in OVERLAP_CASES:
            result = run_overlap_case(name, args.steps)
            results.append(result)
            if not args.json:
                print(
                    f"{name}: host {result.host_ms:.3f} ms, device {result.device_ms:.3f} ms a step; "
                    f"period {result.serial_period_ms:.3f} ms serial, {result.period_ms:.3f} ms overlapped "
                    f"({result.period_ms / max(result.host_ms, result.device_ms):.2f} x max(host, device))",
                    flush=True,
                )
    return results


def _run_plain_cases(names: list[str], args: argparse.Namespace) -> list[CaseResult]:
    if not args.json:
        rounds = f"fastest of {ROUNDS} rounds of {args.steps} steps"
        clock = "the stepping thread's CPU time" if args.clock == "cpu" else "wall time"
        print(f"host ms per engine step ({clock}), model forward stubbed; {rounds}")
        print(f"{'case':<14} {'ms/step':>8}  " + "  ".join(f"{p:>14}" for p in PARTS), flush=True)
    results = []
    for name in names:
        result = run_case(name, args.steps, args.clock)
        results.append(result)
        if not args.json:
            total = result.host_ms_per_step
            shares = "  ".join(f"{result.parts[p]:>7.3f} ({result.parts[p] / total:>3.0%})" for p in PARTS)
            print(f"{name:<14} {total:>8.3f}  {shares}", flush=True)
    return results
