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

Against a server (`--url`, `replay_restart_url`) the same driver plays part one over HTTP and
then waits for the server to be restarted: by `--restart-command`, which replay runs and waits
for, or by the user meanwhile. A restart is seen when `/health` answers 200 and `/version`
names a new `instance` (radixkv's server draws one at each start); from a server that names
none, when `/health` answers 200 after having failed. Part two then runs over HTTP with the
histories part one built, in this same process. One arm runs, named by what the new server did:
`store` if it looked any block up in a KV store (its `kv_store_*_blocks` counters moved), else
`cold`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from radixkv.config import EngineConfig
from radixkv.conversation import Conversation
from radixkv.tools.engine_args import engine_config
from radixkv.tools.replay import build_report, emit, remote_config, replay_engine
from radixkv.tools.replay_driver import drive
from radixkv.tools.replay_http import HttpTransport, Server
from radixkv.tools.replay_result import RunResult
from radixkv.tools.simulate import workload_tokenizer
from radixkv.workloads.format import Workload

ARMS = ("store", "cold", "none")
Replies = list[list[int]] | None  # a session's replies in part one; None: it did not finish part one
RESTART_WAIT_S = 600.0  # how long part two waits for the restarted server
POLL_S = 0.2


@dataclass(slots=True)
class Part:
    """One part of a cut replay as the process that ran it hands it back."""

    result: RunResult
    replies: list[Replies]  # per session of the workload, its replies in this part
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
    _check_cut(workload, after_turn)
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


def _check_cut(workload: Workload, after_turn: int) -> None:
    if after_turn < 1:
        raise ValueError(f"--restart-after-turn must be >= 1, got {after_turn}")
    if not any(len(s.turns) > after_turn for s in workload.sessions):
        raise ValueError(f"--restart-after-turn {after_turn}: no session has more than {after_turn} turns")


def _head(workload: Workload, k: int) -> Workload:
    return Workload([replace(s, turns=s.turns[:k]) for s in workload.sessions], workload.meta)


def _tail(workload: Workload, picked: list[int], k: int) -> Workload:
    """The sessions at the indices `picked`, from turn `k`+1 on."""
    sessions = [workload.sessions[i] for i in picked]
    return Workload([replace(s, turns=s.turns[k:]) for s in sessions], workload.meta)


def replay_restart_url(
    workload: Workload,
    server: Server,
    tokenizer: Any,
    after_turn: int,
    restart_command: str | None = None,
    speed: float = 1.0,
    progress: bool = False,
    wait_s: float = RESTART_WAIT_S,
) -> RestartRun:
    """Part one against `server`, its restart (see the module), part two against the new one:
    a `RestartRun` with one arm, `store` or `cold`."""
    _check_cut(workload, after_turn)
    head = _head(workload, after_turn)
    first = HttpTransport(server, tokenizer, workload)
    histories = [first.history(s) for s in workload.sessions]
    before = server.instance()
    head_result = drive(head, first, speed, progress, histories)
    done = {r.session for r in head_result.records if r.turn == after_turn - 1}
    if restart_command is not None:
        subprocess.run(restart_command, shell=True, check=True)
    elif sys.stderr.isatty():  # a prompt to act, not progress: shown with --json too
        print(f"turns 1..{after_turn} done: restart the server at {server.url} now", file=sys.stderr)
    wait_for_restart(server, before, wait_s)
    picked = [i for i, s in enumerate(workload.sessions) if s.name in done and len(s.turns) > after_turn]
    tail = _tail(workload, picked, after_turn)
    again = HttpTransport(server, tokenizer, workload)
    second = drive(tail, again, speed, progress, [histories[i] for i in picked])
    looked_up = second.metrics.get("kv_store_hit_blocks", 0) + second.metrics.get("kv_store_miss_blocks", 0)
    arm = "store" if looked_up else "cold"
    part = Part(second, [None] * len(workload.sessions), os.getpid())
    return RestartRun(after_turn, {arm: part}, {arm: os.getpid()})


def wait_for_restart(server: Server, before: str | None, wait_s: float = RESTART_WAIT_S) -> None:
    """Returns once `server` is a new instance and healthy (see the module); raises after
    `wait_s` seconds without one."""
    seen_down = False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        healthy = server.healthy()
        if healthy and before is not None:
            now = server.instance()
            if now is not None and now != before:
                return
        elif healthy and seen_down:
            return
        seen_down = seen_down or not healthy
        time.sleep(POLL_S)
    raise TimeoutError(f"the server at {server.url} did not come back restarted within {wait_s:.0f} s")


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
    config: EngineConfig, workload: Workload, k: int, histories: list[Replies], speed: float, progress: bool
) -> Part:
    """Part two on an engine of its own: what the new process runs."""
    from radixkv.engine.sync_engine import Engine

    with Engine(config) as engine:
        return _play_second(engine, workload, k, histories, speed, progress)


def _play_first(engine: Any, workload: Workload, k: int, speed: float, progress: bool) -> Part:
    head = _head(workload, k)
    convs = [Conversation(None if s.uses_ids else engine.tokenizer, s.system) for s in head.sessions]
    result = replay_engine(engine, head, speed, progress, convs)
    finished = zip(head.sessions, convs, strict=True)
    replies = [c.replies if len(c.replies) == len(s.turns) else None for s, c in finished]
    return Part(result, replies, os.getpid())


def _play_second(
    engine: Any, workload: Workload, k: int, histories: list[Replies], speed: float, progress: bool
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
    tail = _tail(workload, picked, k)
    result = replay_engine(engine, tail, speed, progress, convs)
    replies: list[Replies] = [None] * len(workload.sessions)
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
        return _run_remote(args, workload)
    if args.restart_command is not None:
        raise ValueError("--restart-command restarts a server: it needs --url")
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


def _run_remote(args: argparse.Namespace, workload: Workload) -> int:
    """`--restart-after-turn K --url URL [--restart-command CMD]`: one arm, the server's restart."""
    if args.compare:
        raise ValueError("--restart-after-turn with --url runs the server's one restart: no --compare")
    server = Server(args.url, args.api_key, args.endpoint, extras=args.extras)
    tokenizer = workload_tokenizer(workload, args.model)
    progress = sys.stderr.isatty() and not args.json
    result = replay_restart_url(
        workload, server, tokenizer, args.restart_after_turn, args.restart_command, args.speed, progress
    )
    built = build_report(args, server.served_model(), remote_config(args), restart=restart_section(result))
    emit(args, built, {arm: part.result for arm, part in result.parts.items()}, format_restart)
    return 0
