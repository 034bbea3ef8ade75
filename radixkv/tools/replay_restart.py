"""`radixkv replay --restart-after-turn K`: what a restart in the middle of conversations keeps.

The replay is cut after turn K of every session. Part one, turns 1..K, runs on one engine; that
engine is closed (its device and host memory freed, its cached blocks written to the KV store
first) and part two, turns K+1 on, runs on a fresh engine of the same configuration in a new
process, spawned (a fresh interpreter that inherits nothing), whose conversations carry part
one's histories: the users' messages and the replies the first engine generated
(`Conversation.resumed`). Part two starts once the new engine is up; each session's turn K+1 is
then due at the session's `arrival` plus that turn's think time (both divided by the speed), so
the clients come back with the spacing they first came with. Later turns follow as in any replay.

The arms, each measured over the turns after K only:
- `store`: the restart over the KV store (`--kv-store`, or a temporary `file://` one);
- `cold`: the same restart without a store, from the same part one;
- `none`: no restart: part two runs on part one's engine (no store), on the same schedule.
Replies are greedy, so every arm must send the same prompts and get the same tokens; `same_tokens`
says whether an arm's replies after K equal the `none` arm's token for token.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from radixkv.config import EngineConfig
from radixkv.conversation import Conversation
from radixkv.tools.engine_args import engine_config
from radixkv.tools.replay import build_report, emit, replay_engine
from radixkv.tools.replay_result import RunResult
from radixkv.workloads.format import Workload

ARMS = ("store", "cold", "none")
History = list[list[int]] | None  # a session's replies in part one; None: it did not finish part one


@dataclass(slots=True)
class Part:
    """One part of a cut replay as the process that ran it hands it back."""

    result: RunResult
    replies: list[History]  # per session of the workload, its replies in this part
    pid: int  # the process the part's engine ran in


@dataclass(slots=True)
class RestartRun:
    """The arms that ran (by name, the second parts) and the process of each arm's first part."""

    after_turn: int
    parts: dict[str, Part]
    first_pids: dict[str, int]


def replay_restart(
    workload: Workload,
    config: EngineConfig,
    after_turn: int,
    arms: tuple[str, ...] = ARMS,
    speed: float = 1.0,
    progress: bool = False,
) -> RestartRun:
    """Runs `arms` (see the module) over `workload` cut after turn `after_turn`. The `store` arm
    uses `config.kv_store`, or a temporary `file://` store when it is None; `cold` and `none`
    run without one."""
    if after_turn < 1:
        raise ValueError(f"--restart-after-turn must be >= 1, got {after_turn}")
    if not any(len(s.turns) > after_turn for s in workload.sessions):
        raise ValueError(f"--restart-after-turn {after_turn}: no session has more than {after_turn} turns")
    storeless = replace(config, kv_store=None)
    parts: dict[str, Part] = {}
    first_pids: dict[str, int] = {}
    if "none" in arms:
        first, parts["none"] = _both_parts(storeless, workload, after_turn, speed, progress)
        first_pids["none"] = first.pid
    restarted = [arm for arm in arms if arm != "none"]
    if restarted:
        with tempfile.TemporaryDirectory(prefix="radixkv-restart-") as scratch:
            stored = replace(config, kv_store=config.kv_store or f"file://{scratch}")
            head_config = stored if "store" in restarted else storeless
            first = _first_part(head_config, workload, after_turn, speed, progress)
            for arm in restarted:
                arm_config = stored if arm == "store" else storeless
                args = (arm_config, workload, after_turn, first.replies, speed, progress)
                parts[arm] = _in_new_process(_second_part, *args)
                first_pids[arm] = first.pid
    return RestartRun(after_turn, {arm: parts[arm] for arm in arms}, first_pids)


def _first_part(config: EngineConfig, workload: Workload, k: int, speed: float, progress: bool) -> Part:
    from radixkv.engine.sync_engine import Engine  # here, so that `radixkv --help` does not load torch

    with Engine(config) as engine:
        return _play_first(engine, workload, k, speed, progress)


def _both_parts(
    config: EngineConfig, workload: Workload, k: int, speed: float, progress: bool
) -> tuple[Part, Part]:
    from radixkv.engine.sync_engine import Engine

    with Engine(config) as engine:
        first = _play_first(engine, workload, k, speed, progress)
        return first, _play_second(engine, workload, k, first.replies, speed, progress)


def _second_part(
    config: EngineConfig, workload: Workload, k: int, histories: list[History], speed: float, progress: bool
) -> Part:
    """Part two on an engine of its own: what the new process runs."""
    from radixkv.engine.sync_engine import Engine

    with Engine(config) as engine:
        return _play_second(engine, workload, k, histories, speed, progress)


def _play_first(engine: Any, workload: Workload, k: int, speed: float, progress: bool) -> Part:
    head = Workload([replace(s, turns=s.turns[:k]) for s in workload.sessions], workload.meta)
    convs = [Conversation(None if s.uses_ids else engine.tokenizer, s.system) for s in head.sessions]
    result = replay_engine(engine, head, speed, progress, convs)
    finished = zip(head.sessions, convs, strict=True)
    replies = [c.replies if len(c.replies) == len(s.turns) else None for s, c in finished]
    return Part(result, replies, os.getpid())


def _play_second(
    engine: Any, workload: Workload, k: int, histories: list[History], speed: float, progress: bool
) -> Part:
    """Turns `k`+1 on of each session that finished part one and has more."""
    picked = [i for i, s in enumerate(workload.sessions) if histories[i] is not None and len(s.turns) > k]
    sessions = [workload.sessions[i] for i in picked]
    convs = [
        Conversation.resumed(
            None if s.uses_ids else engine.tokenizer, s.system, [t.user for t in s.turns[:k]], histories[i]
        )
        for i, s in zip(picked, sessions, strict=True)
    ]
    tail = Workload([replace(s, turns=s.turns[k:]) for s in sessions], workload.meta)
    result = replay_engine(engine, tail, speed, progress, convs)
    replies: list[History] = [None] * len(workload.sessions)
    for i, conv in zip(picked, convs, strict=True):
        replies[i] = conv.replies[k:]
    return Part(result, replies, os.getpid())


def _in_new_process(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a freshly spawned interpreter: no memory, threads or device state of this one."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def arm_summary(part: Part, none: Part | None) -> dict[str, Any]:
    """An arm's figures over the turns after K (docs/restart.md)."""
    records = part.result.records
    prompt = sum(r.prompt_tokens for r in records)
    ttft = [r.ttft_s for r in records]
    summary: dict[str, Any] = {
        "turns": len(records),
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else 0.0,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else 0.0,
        "hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        "store_hit_rate": part.result.metrics.get("store_cache_hits", 0) / prompt if prompt else 0.0,
        "failed_requests": len(part.result.failed),
    }
    if none is not None and part is not none:
        summary["same_tokens"] = part.replies == none.replies
    return summary


def restart_section(run: RestartRun) -> dict[str, Any]:
    """The report's `restart` object: `after_turn`, then each arm's summary (None if not run)."""
    none = run.parts.get("none")
    return {
        "after_turn": run.after_turn,
        **{arm: arm_summary(run.parts[arm], none) if arm in run.parts else None for arm in ARMS},
    }


def format_restart(report: dict[str, Any]) -> str:
    """The `restart` object as a table, with the two ratios the restart is judged by."""
    section = report["restart"]
    ran = [arm for arm in ARMS if section[arm] is not None]
    lines = [
        f"{report['workload']} on {report['model']}: restart after turn {section['after_turn']}, "
        "figures over the turns after it",
        f"{'arm':<6}{'turns':>7}{'TTFT p50 (s)':>14}{'TTFT p90 (s)':>14}{'hit rate':>10}{'store hits':>12}"
        f"{'same tokens':>13}",
    ]
    for arm in ran:
        a = section[arm]
        same = {True: "yes", False: "NO"}.get(a.get("same_tokens"), "-")
        lines.append(
            f"{arm:<6}{a['turns']:>7d}{a['ttft_p50_s']:>14.3f}{a['ttft_p90_s']:>14.3f}{a['hit_rate']:>10.3f}"
            f"{a['store_hit_rate']:>12.3f}{same:>13}"
        )
    store, cold, none = (section[arm] for arm in ARMS)
    if store and cold and cold["ttft_p50_s"]:
        ratio = store["ttft_p50_s"] / cold["ttft_p50_s"]
        lines.append(f"TTFT p50 with the store / a cold restart: {ratio:.3f}x")
    if store and none and none["hit_rate"]:
        lines.append(f"hit rate with the store / no restart: {store['hit_rate'] / none['hit_rate']:.3f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace, workload: Workload) -> int:
    """`radixkv replay WORKLOAD --restart-after-turn K [--kv-store URL] [--compare]`: without
    `--compare`, the one restart the options name (over the store if given, else cold)."""
    if args.url is not None:
        raise ValueError("--restart-after-turn replays in process; against --url, see docs/restart.md")
    if args.compare_host_tier:
        raise ValueError("--restart-after-turn does not take --compare-host-tier")
    config = engine_config(args)
    arms = ARMS if args.compare else ("store",) if config.kv_store else ("cold",)
    progress = sys.stderr.isatty() and not args.json
    result = replay_restart(workload, config, args.restart_after_turn, arms, args.speed, progress)
    settings = {
        "block_size": config.block_size,
        "kv_cache_memory": config.kv_cache_memory,
        "kv_store": config.kv_store,
        "speed": args.speed,
    }
    built = build_report(args, args.model, settings, restart=restart_section(result))
    emit(args, built, {arm: part.result for arm, part in result.parts.items()}, format_restart)
    return 0

