"""`radixkv bench model`: a model of a real size on a GPU, end to end, in one run.

For each shape (`llama-3-8b-shape`, `qwen2.5-1.5b-shape`: the real layers, heads, widths and
vocabulary with random bfloat16 weights drawn on the device, `radixkv.model.presets`):
- prefill at 1 x 8,192 and 8 x 2,048 new tokens: tokens/s and model FLOP utilization (MFU), the
  FLOPs a forward needs (every linear layer's 2 x weights per token, the LM head for the rows that
  get logits, and causal attention's QK and PV products over the keys each query sees) over the
  time and the device's dense bfloat16 peak;
- decode, one new token for each of 1, 32 and 256 sequences at 2,048 tokens of context: the
  forward's milliseconds (a CUDA-graph replay, as the engine runs it) and model bandwidth
  utilization (MBU), the bytes a step must read (every weight but the embedding table, plus every
  sequence's K and V) over the time and the device's peak bandwidth;
- the multi-turn replay of a chat workload (`--workload`, default `workloads/chat_small.jsonl`)
  with the prefix cache on and off: hit rate and TTFT p50, and their ratio, the project's
  headline at a real size.
Forwards are timed directly on the engine's `ModelRunner` (its KV blocks, its launch plans, its
graphs), each case warmed up once and timed as the median of `--repeats` runs. Peaks come from
`radixkv.tools.device_peaks`. On a machine without CUDA the command refuses: these sizes are for a
GPU, and `radixkv bench engine` measures the host's side anywhere. torch loads only when it runs,
so that `radixkv --help` stays light.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

PREFILL_CASES = ((1, 8192), (8, 2048))
"""(sequences, new tokens each) for the prefill measurement."""
DECODE_BATCHES = (1, 32, 256)
DECODE_CONTEXT = 2048
DEFAULT_WORKLOAD = "workloads/chat_small.jsonl"


class Plan(NamedTuple):
    """What one shape's run measures; `run` uses the defaults above, the tests smaller ones."""

    prefill: tuple[tuple[int, int], ...] = PREFILL_CASES
    decode_batches: tuple[int, ...] = DECODE_BATCHES
    decode_context: int = DECODE_CONTEXT
    repeats: int = 5

    @property
    def blocks_needed(self) -> int:
        """Sequences in the largest case times its longest context, as tokens (the runner's blocks)."""
        prefill = max(n * t for n, t in self.prefill) if self.prefill else 0
        decode = max(self.decode_batches, default=0) * self.decode_context
        return max(prefill, decode)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        help="measure only this real-size preset (repeatable; default: every one, see REAL_SHAPE_PRESETS)",
    )
    parser.add_argument(
        "--workload", default=DEFAULT_WORKLOAD, help="the chat workload replayed with and without the cache"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per forward case")
    parser.add_argument("--json", action="store_true", help="print only a JSON object")


def run(args: argparse.Namespace) -> int:
    import torch

    from radixkv.model.presets import REAL_SHAPE_PRESETS

    unknown = sorted(set(args.model or ()) - set(REAL_SHAPE_PRESETS))
    if unknown:
        raise ValueError(f"--model must be one of {', '.join(REAL_SHAPE_PRESETS)}, got {', '.join(unknown)}")
    if not torch.cuda.is_available():
        print(
            "radixkv bench model measures real-size models on a CUDA GPU, and this machine has none; "
            "`radixkv bench engine` measures the host's side of a step anywhere",
            file=sys.stderr,
        )
        return 2
    from radixkv.tools.device_peaks import peak_bandwidth, peak_bf16_flops

    device = torch.device("cuda")
    flops, flops_source = peak_bf16_flops(device)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "peak_bf16_flops": flops,
        "peak_flops_source": flops_source,
        "peak_bandwidth": peak_bandwidth(device),
        "models": [],
    }
    plan = Plan(repeats=args.repeats)
    workload = Path(args.workload)
    for name in args.model or REAL_SHAPE_PRESETS:
        if not args.json:
            print(f"{name}: building on {report['device']} ...", file=sys.stderr, flush=True)
        result = measure_forwards(_engine_config(name, plan), plan, flops, report["peak_bandwidth"])
        result["replay"] = replay_ratio(name, workload) if workload.is_file() else None
        report["models"].append(result)
        if not args.json:
            print(format_model(result), flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _engine_config(name: str, plan: Plan) -> Any:
    from radixkv.config import EngineConfig

    longest = max([t for _, t in plan.prefill] + [plan.decode_context])
    return EngineConfig(
        model=name,
        dtype="bfloat16",
        max_model_len=longest,
        max_num_seqs=max(plan.decode_batches),
        max_num_batched_tokens=max(n * t for n, t in plan.prefill),
        enable_prefix_cache=False,
    )


def measure_forwards(config: Any, plan: Plan, peak_flops: float, peak_bytes_per_s: float) -> dict[str, Any]:
    """Prefill and decode cases of `plan` on a fresh engine built from `config` (closed after)."""
    from radixkv.engine.sync_engine import Engine

    with Engine(config) as engine:
        if engine.pool.num_blocks * engine.pool.block_size < plan.blocks_needed:
            raise ValueError(
                f"{config.model}: the KV cache holds {engine.pool.num_blocks} blocks, "
                f"too few for {plan.blocks_needed} tokens of the largest case"
            )
        costs = ForwardCosts.of(engine.model)
        prefill = [
            _prefill_case(engine, costs, num_seqs, tokens, plan.repeats, peak_flops)
            for num_seqs, tokens in plan.prefill
        ]
        decode = [
            _decode_case(engine, costs, batch, plan.decode_context, plan.repeats, peak_bytes_per_s)
            for batch in plan.decode_batches
        ]
        result = {"name": config.model, "params": costs.params, "prefill": prefill, "decode": decode}
    gc.collect()  # the next engine profiles the device's free memory
    return result


class ForwardCosts(NamedTuple):
    """A model's arithmetic and traffic per token, from its modules and config."""

    params: int
    linear_params: int  # every linear layer but the LM head: applied to every token
    lm_head_params: int  # applied only to the rows that get logits
    weight_bytes: int  # what a decode step reads of the weights (all but the embedding table)
    attention_width: int  # query heads x head size: QK and PV cost 2 x 2 x this FLOPs per key
    kv_bytes_per_token: int  # K and V of one token, every layer

    @classmethod
    def of(cls, loaded: Any) -> ForwardCosts:
        import torch

        model = loaded.model
        head = model.get_output_embeddings()
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        linear = sum(m.weight.numel() for m in linears)
        embedding = model.get_input_embeddings().weight
        tied = head.weight.data_ptr() == embedding.data_ptr()
        params = sum(p.numel() for p in model.parameters())
        itemsize = embedding.element_size()
        read = params - (0 if tied else embedding.numel())  # a tied table is read whole as the LM head
        config = loaded.config
        return cls(
            params=params,
            linear_params=linear,
            lm_head_params=head.weight.numel(),
            weight_bytes=read * itemsize,
            attention_width=config.num_attention_heads * loaded.head_dim,
            kv_bytes_per_token=2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * itemsize,
        )

    def forward_flops(self, num_layers: int, sequences: list[tuple[int, int]], logit_rows: int) -> int:
        """FLOPs of one forward over `sequences` of (new tokens, tokens cached before them)."""
        tokens = sum(new for new, _ in sequences)
        # Query j of a sequence with `cached` tokens before its new ones attends to cached + j + 1 keys.
        keys = sum(new * cached + new * (new + 1) // 2 for new, cached in sequences)
        attention = 4 * self.attention_width * keys * num_layers
        return 2 * self.linear_params * tokens + 2 * self.lm_head_params * logit_rows + attention


def _timed_forward_ms(engine: Any, chunks: list[Any], repeats: int) -> float:
    from radixkv.tools.bench_kernels import median_ms

    return median_ms(lambda: engine.runner.forward(chunks), repeats, engine.runner.device)[1]


def _prefill_case(
    engine: Any, costs: ForwardCosts, num_seqs: int, tokens: int, repeats: int, peak_flops: float
) -> dict[str, Any]:
    chunks = _chunks(engine, [tokens] * num_seqs, start_pos=0)
    ms = _timed_forward_ms(engine, chunks, repeats)
    flops = costs.forward_flops(engine.model.num_layers, [(tokens, 0)] * num_seqs, logit_rows=num_seqs)
    return {
        "sequences": num_seqs,
        "tokens": tokens,
        "ms": ms,
        "tokens_per_s": num_seqs * tokens / (ms * 1e-3),
        "tflops": flops / (ms * 1e-3) / 1e12,
        "mfu": flops / (ms * 1e-3) / peak_flops,
    }


def _decode_case(
    engine: Any, costs: ForwardCosts, batch: int, context: int, repeats: int, peak_bytes_per_s: float
) -> dict[str, Any]:
    chunks = _chunks(engine, [context] * batch, start_pos=context - 1)
    ms = _timed_forward_ms(engine, chunks, repeats)
    read = costs.weight_bytes + batch * context * costs.kv_bytes_per_token
    return {
        "batch": batch,
        "context": context,
        "ms": ms,
        "tokens_per_s": batch / (ms * 1e-3),
        "gb_per_s": read / (ms * 1e-3) / 1e9,
        "mbu": read / (ms * 1e-3) / peak_bytes_per_s,
    }


def _chunks(engine: Any, lengths: list[int], start_pos: int) -> list[Any]:
    """Sequences of `lengths` tokens, each on blocks of its own; the tokens from `start_pos` on are
    new (the KV before it is whatever the blocks hold: the arithmetic and traffic are the same)."""
    import torch

    from radixkv.scheduler.chunk import SequenceChunk

    size = engine.pool.block_size
    generator = torch.Generator().manual_seed(0)
    chunks, first = [], 0
    for length in lengths:
        blocks = -(-length // size)
        ids = torch.randint(0, 256, (length - start_pos,), generator=generator).tolist()
        table = list(range(first, first + blocks))
        scratch = [table] * len(engine.kv.windows)  # KV groups: scratch tables (never read back)
        chunks.append(SequenceChunk(ids, start_pos, table, group_tables=scratch))
        first += blocks
    return chunks


def replay_ratio(name: str, workload_path: Path) -> dict[str, Any]:
    """The workload replayed with the prefix cache and without (same arrivals, fresh engines)."""
    from radixkv.config import EngineConfig
    from radixkv.tools.replay import replay, summarize
    from radixkv.workloads.format import read_workload

    workload = read_workload(workload_path)
    runs = {}
    for key, cache in (("prefix_cache", True), ("no_prefix_cache", False)):
        config = EngineConfig(model=name, dtype="bfloat16", enable_prefix_cache=cache)
        runs[key] = summarize(replay(workload, config))
        gc.collect()
    with_cache, without = runs["prefix_cache"]["ttft_s"]["p50"], runs["no_prefix_cache"]["ttft_s"]["p50"]
    return {
        "workload": str(workload_path),
        "hit_rate": runs["prefix_cache"]["hit_rate"],
        "ttft_p50_s": with_cache,
        "ttft_p50_no_cache_s": without,
        "ttft_p50_ratio": with_cache / without if without else None,
    }


def format_model(result: dict[str, Any]) -> str:
    lines = [f"{result['name']} ({result['params'] / 1e9:.2f}B parameters)"]
    for case in result["prefill"]:
        lines.append(
            f"  prefill {case['sequences']} x {case['tokens']:>5}: {case['ms']:8.2f} ms  "
            f"{case['tokens_per_s']:>10,.0f} tok/s  {case['tflops']:6.1f} TFLOP/s  MFU {case['mfu']:.2f}"
        )
    for case in result["decode"]:
        lines.append(
            f"  decode  {case['batch']:>3} at {case['context']}: {case['ms']:8.2f} ms  "
            f"{case['tokens_per_s']:>10,.0f} tok/s  {case['gb_per_s']:6.0f} GB/s     MBU {case['mbu']:.2f}"
        )
    replay = result.get("replay")
    if replay:
        ratio = replay["ttft_p50_ratio"]
        lines.append(
            f"  replay {replay['workload']}: hit rate {replay['hit_rate']:.3f}, TTFT p50 "
            f"{replay['ttft_p50_s'] * 1e3:.1f} ms with the cache, "
            f"{replay['ttft_p50_no_cache_s'] * 1e3:.1f} ms without ({ratio:.2f}x)"
            if ratio is not None
            else "  replay: no TTFT without the cache"
        )
    return "\n".join(lines)
