"""`radixkv replay`: a multi-turn workload through the engine, timed as users would see it.

One driver plays the conversations (`radixkv.tools.replay_driver`: arrivals and think times
divided by `--speed`, each prompt the whole conversation so far, the engine's own replies
included, TTFT from when a turn was due) over one of two transports: an engine in this process
(`radixkv.tools.replay_in_process`) or a server at `--url` (`radixkv.tools.replay_http`).
Replies are greedy and run to `max_tokens`, so the runs with and without the prefix cache
generate the same tokens and send the same prompts. This module holds the command line and the
report (`build_report`, written by `emit`); `--restart-after-turn` is `radixkv.tools.replay_restart`.

`--compare` replays the same workload again with the prefix cache off and sets both runs side
by side. The report's counters come from the engine's own metrics; `ideal_hit_rate` is what an
infinite cache would find in the workload's prompts (`radixkv.tools.simulate`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from radixkv.config import EngineConfig
from radixkv.conversation import Conversation
from radixkv.tools.engine_args import add_engine_arguments, engine_config
from radixkv.tools.replay_driver import drive
from radixkv.tools.replay_in_process import EngineTransport
from radixkv.tools.replay_result import RunResult
from radixkv.tools.simulate import hit_tokens, requests_from_workload, workload_tokenizer
from radixkv.workloads.format import Workload, read_workload


def replay(workload: Workload, config: EngineConfig, speed: float = 1.0, progress: bool = False) -> RunResult:
    """Replays every session of `workload` through a fresh engine built from `config`, closed
    at the end (which stops its tensor-parallel workers, if any)."""
    from radixkv.engine.sync_engine import Engine  # here, so that `radixkv --help` does not load torch

    with Engine(config) as engine:
        return replay_engine(engine, workload, speed, progress)


def replay_engine(
    engine: Any, workload: Workload, speed: float, progress: bool, convs: list[Conversation] | None = None
) -> RunResult:
    """Replays `workload` on an open engine (`radixkv.tools.replay_driver.drive`); `convs`, one
    per session, are the conversations its turns continue, grown in place."""
    return drive(workload, EngineTransport(engine), speed, progress, convs)


def summarize(result: RunResult) -> dict[str, Any]:
    """A run as the report's `RUN` object (docs/cli.md, "replay --report JSON")."""
    recs = result.records
    prompt = sum(r.prompt_tokens for r in recs)
    m = result.metrics
    cached = m.get("cached_tokens", sum(r.cached_tokens for r in recs))  # a server's counter, if used
    output = sum(r.output_tokens for r in recs)
    return {
        "requests": len(recs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "output_tokens": output,
        "wall_s": result.wall_s,
        "throughput_tok_s": output / result.wall_s if result.wall_s else 0.0,
        "ttft_s": _stats([r.ttft_s for r in recs]),
        "tpot_s": _stats([r.tpot_s for r in recs]),
        "e2e_s": _stats([r.e2e_s for r in recs]),
        "kv_usage_peak": result.kv_usage_peak,
        "kv_utilization": result.kv_utilization,
        "preemptions": m["num_preemptions"],
        "evicted_blocks": m["num_evicted_blocks"],
        "cow_copies": m["num_cow_copies"],
        "host_hit_rate": m["host_cache_hits"] / prompt if prompt else 0.0,
        "failed_requests": len(result.failed),
        "store_hit_rate": m.get("store_cache_hits", 0) / prompt if prompt else 0.0,
    }


def ideal_hit_rate(workload: Workload, tokenizer: Any, block_size: int) -> float:
    requests = requests_from_workload(workload, tokenizer)
    prompt = sum(len(r.prompt) for r in requests)
    blocks = sum(-(-(len(r.prompt) + len(r.output)) // block_size) for r in requests)
    return hit_tokens(requests, max(blocks, 1), block_size, "lru") / max(prompt, 1)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


# ------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", type=Path, help="a workload file (JSONL, one chat session a line)")
    parser.add_argument("--compare", action="store_true", help="replay again with the prefix cache off")
    parser.add_argument("--report", type=Path, help="write the JSON report here")
    parser.add_argument("--plot", type=Path, help="write a PNG of TTFT and hit rate here (needs matplotlib)")
    parser.add_argument(
        "--report-html", type=Path, help="write the report as one self-contained HTML page of plots here"
    )
    parser.add_argument("--speed", type=float, default=1.0, help="arrival and think times divided by this")
    add_engine_arguments(parser, prefix_cache_switch=False)
    parser.add_argument(
        "--compare-host-tier",
        action="store_true",
        help="replay again without the host tier (needs --host-kv-cache-memory)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")
    parser.add_argument(
        "--restart-after-turn",
        type=int,
        default=None,
        metavar="K",
        help="restart the engine, in a new process, after turn K of every session and report the "
        "later turns (with --compare: over the store, cold, and unrestarted); see docs/restart.md",
    )
    remote = parser.add_argument_group("against a server (instead of in process)")
    remote.add_argument(
        "--restart-command",
        default=None,
        metavar="CMD",
        help="with --restart-after-turn and --url: a shell command that restarts the server, run "
        "after turn K (default: wait for the server to be restarted by hand)",
    )
    remote.add_argument(
        "--url", default=None, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"
    )
    remote.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    remote.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default=None,
        help="default: completions for token-id workloads, chat for text ones",
    )
    remote.add_argument(
        "--extras",
        choices=["auto", "on", "off"],
        default="auto",
        help="send radixkv's extra fields (ignore_eos, session_id, return_tokens_as_token_ids): "
        "auto probes the server once",
    )


def run(args: argparse.Namespace) -> int:
    if args.speed <= 0:
        raise ValueError(f"--speed must be > 0, got {args.speed}")
    workload = read_workload(args.workload)
    if args.url is not None:
        return _run_remote(args, workload)
    config = engine_config(args)
    base = {
        "model": config.model,
        "block_size": config.block_size,
        "kv_cache_memory": config.kv_cache_memory,
        "kv_cache_dtype": config.kv_cache_dtype,
        "eviction": config.eviction,
        "tensor_parallel_size": config.tensor_parallel_size,
        "host_kv_cache_memory": config.host_kv_cache_memory,
        "host_write_through": config.host_write_through,
        "preemption_mode": config.preemption_mode,
        "kv_store": config.kv_store,
    }
    if args.compare_host_tier and not base["host_kv_cache_memory"]:
        raise ValueError("--compare-host-tier needs --host-kv-cache-memory")
    progress = sys.stderr.isatty() and not args.json
    device_only = replace(config, host_kv_cache_memory=0, preemption_mode="recompute", kv_store=None)
    configs = {"prefix_cache": config}
    if args.compare_host_tier:
        configs["no_host_tier"] = device_only
    if args.compare:
        configs["no_prefix_cache"] = replace(device_only, enable_prefix_cache=False)
    runs = {}
    for name, run_config in configs.items():
        runs[name] = replay(workload, run_config, args.speed, progress)
    tokenizer = workload_tokenizer(workload, args.model)
    ideal = ideal_hit_rate(workload, tokenizer, args.block_size)
    built = build_report(args, args.model, {**base, "speed": args.speed}, runs, ideal_hit_rate=ideal)
    emit(args, built, runs)
    return 0


def _run_remote(args: argparse.Namespace, workload: Workload) -> int:
    """`--url`: one run against the server; its report has the same shape, `config` naming the server."""
    from radixkv.tools.replay_http import Server, replay_url

    if args.compare:
        raise ValueError("--compare replays in process; against --url, run a server without its cache")
    tokenizer = workload_tokenizer(workload, args.model)
    server = Server(args.url, args.api_key, args.endpoint, extras=args.extras)
    progress = sys.stderr.isatty() and not args.json
    runs = {"prefix_cache": replay_url(workload, server, tokenizer, args.speed, progress)}
    ideal = ideal_hit_rate(workload, tokenizer, args.block_size)
    built = build_report(args, server.served_model(), remote_config(args), runs, ideal_hit_rate=ideal)
    emit(args, built, runs)
    return 0


def remote_config(args: argparse.Namespace) -> dict[str, Any]:
    """The report's `config` for a replay against `--url`: the server, not an engine's settings."""
    return {"url": args.url, "endpoint": args.endpoint, "speed": args.speed}


def build_report(
    args: argparse.Namespace,
    model: str | None,
    config: dict[str, Any],
    runs: dict[str, RunResult] | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """The one place a replay's report is built (docs/cli.md, "replay --report JSON"):
    `workload`, `model`, `config`, then `sections` in order (`ideal_hit_rate`, or a restart's
    `restart`), then `runs`, each summarized, if given."""
    built = {"workload": str(args.workload), "model": model, "config": config, **sections}
    if runs is not None:
        built["runs"] = {name: summarize(result) for name, result in runs.items()}
    return built


def emit(
    args: argparse.Namespace,
    report: dict[str, Any],
    runs: dict[str, RunResult],
    text: Callable[[dict[str, Any]], str] | None = None,
) -> None:
    """Writes the report, its HTML page and plot (of `runs`) where asked, and prints the report: as JSON with
    `--json`, else through `text` (default `format_report`)."""
    for name, result in runs.items():
        if result.failed:  # the report counts them; say why, so that a failed run is not a mystery
            first = result.failed[0]
            print(f"{name}: {len(result.failed)} requests failed, the first: {first}", file=sys.stderr)
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        from radixkv.tools.plot import plot_replay

        plot_replay({name: r.records for name, r in runs.items()}, args.plot)
    if args.report_html:
        from radixkv.tools import report_html

        records = {name: r.records for name, r in runs.items()}
        report_html.write(args.report_html, report_html.replay_report(report, records))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print((text or format_report)(report))


def format_report(report: dict[str, Any]) -> str:
    runs = report["runs"]
    names = list(runs)
    rows = [
        ("requests", "{:d}", lambda r: r["requests"]),
        ("prompt tokens", "{:,d}", lambda r: r["prompt_tokens"]),
        ("hit rate", "{:.3f}", lambda r: r["hit_rate"]),
        ("host hit rate", "{:.3f}", lambda r: r["host_hit_rate"]),
        ("store hit rate", "{:.3f}", lambda r: r.get("store_hit_rate", 0.0)),
        ("TTFT mean (s)", "{:.3f}", lambda r: r["ttft_s"]["mean"]),
        ("TTFT p50 (s)", "{:.3f}", lambda r: r["ttft_s"]["p50"]),
        ("TTFT p90 (s)", "{:.3f}", lambda r: r["ttft_s"]["p90"]),
        ("TTFT p99 (s)", "{:.3f}", lambda r: r["ttft_s"]["p99"]),
        ("TPOT p50 (s)", "{:.4f}", lambda r: r["tpot_s"]["p50"]),
        ("E2E p50 (s)", "{:.3f}", lambda r: r["e2e_s"]["p50"]),
        ("output tok/s", "{:.1f}", lambda r: r["throughput_tok_s"]),
        ("wall (s)", "{:.1f}", lambda r: r["wall_s"]),
        ("KV usage peak", "{:.3f}", lambda r: r["kv_usage_peak"]),
        ("KV utilization", "{:.3f}", lambda r: r["kv_utilization"]),
        ("preemptions", "{:d}", lambda r: r["preemptions"]),
        ("failed requests", "{:d}", lambda r: r["failed_requests"]),
        ("evicted blocks", "{:d}", lambda r: r["evicted_blocks"]),
        ("COW copies", "{:d}", lambda r: r["cow_copies"]),
    ]
    width = max(len(n) for n in names) + 2
    lines = [
        f"{report['workload']} on {report['model']}: ideal hit rate {report['ideal_hit_rate']:.3f}",
        f"{'':<16}" + "".join(f"{n:>{width}}" for n in names),
    ]
    for label, fmt, get in rows:
        lines.append(f"{label:<16}" + "".join(f"{fmt.format(get(runs[n])):>{width}}" for n in names))
    for other, what in (("no_host_tier", "the host tier"), ("no_prefix_cache", "the prefix cache")):
        if other in runs:
            on, off = runs["prefix_cache"]["ttft_s"], runs[other]["ttft_s"]
            lines.append(
                f"TTFT with / without {what}: p50 {_ratio(on['p50'], off['p50'])}, "
                f"mean {_ratio(on['mean'], off['mean'])}"
            )
    ideal = report["ideal_hit_rate"]
    if ideal:
        shares = ", ".join(f"{n} {runs[n]['hit_rate'] / ideal:.3f}" for n in names if n != "no_prefix_cache")
        lines.append(f"hit rate / ideal: {shares}")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    """a / b as the report prints it; `n/a` where b is 0 (a run in which no turn finished)."""
    return f"{a / b:.3f}x" if b else "n/a"
