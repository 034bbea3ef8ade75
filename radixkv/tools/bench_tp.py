"""`radixkv bench tp`: the cost of a step with 1 rank and with N, side by side in one run.

Both engines serve the same model and run the same batch (`--batch` prompts of `--prompt-len`
random tokens, `--decode-tokens` greedy tokens each, prefix cache off so every round does the
same work): one prefill step, then decode steps. Rounds alternate between the engines, and each
figure is the fastest round's, so a shared machine's bursts do not set it. On a CPU, where both
ranks share the cores, the ratio measures what tensor parallelism adds per step (the step's
broadcast to the workers and two all-reduces per layer) rather than a speed-up; on a machine
with N devices it is the decode speed-up or slowdown at N ranks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from radixkv.engine.sync_engine import Engine


class StepTimes(NamedTuple):
    prefill_ms: float  # the one step that prefills the whole batch
    decode_ms: float  # median decode step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama", help="preset name or local Hugging Face folder")
    parser.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks to compare with 1")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only a JSON object")


def run(args: argparse.Namespace) -> int:
    from radixkv import Engine, EngineConfig

    if min(args.batch, args.prompt_len, args.decode_tokens, args.rounds) < 1:
        raise ValueError("--batch, --prompt-len, --decode-tokens and --rounds must be >= 1")
    sizes = (1, args.tensor_parallel_size)
    common = {"model": args.model, "device": args.device, "kv_cache_memory": "64MiB"}
    common["enable_prefix_cache"] = False  # every round does the same work
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    with (
        Engine(EngineConfig(**common, tensor_parallel_size=sizes[0])) as one,
        Engine(EngineConfig(**common, tensor_parallel_size=sizes[1])) as many,
    ):
        engines = (one, many)
        for engine in engines:  # warm-up: kernels compiled, buffers grown
            measure(engine, prompts[:1], 2)
        rounds: dict[int, list[StepTimes]] = {size: [] for size in sizes}
        for _ in range(args.rounds):
            for size, engine in zip(sizes, engines, strict=True):
                rounds[size].append(measure(engine, prompts, args.decode_tokens))
    best = {size: StepTimes(*map(min, zip(*times, strict=True))) for size, times in rounds.items()}
    n = sizes[1]
    report = {
        "model": args.model,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "ranks": {str(size): times._asdict() for size, times in best.items()},
        f"prefill_ratio_{n}_over_1": best[n].prefill_ms / best[1].prefill_ms,
        f"decode_ratio_{n}_over_1": best[n].decode_ms / best[1].decode_ms,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    for size, times in best.items():
        print(f"{size} rank(s): prefill {times.prefill_ms:7.1f} ms, decode {times.decode_ms:7.1f} ms")
    prefill, decode = report[f"prefill_ratio_{n}_over_1"], report[f"decode_ratio_{n}_over_1"]
    print(f"{n} ranks / 1 rank: prefill step x{prefill:.2f}, decode step x{decode:.2f}")
    return 0


def measure(engine: Engine, prompts: list[list[int]], decode_tokens: int) -> StepTimes:
    """Runs `prompts` to `decode_tokens` greedy tokens each, timing every step."""
    from radixkv import SamplingParams

    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    times = []
    while not all(engine.is_finished(i) for i in ids):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    for i in ids:
        engine.output(i)
    return StepTimes(times[0], statistics.median(times[1:]) if len(times) > 1 else float("nan"))
