"""`radixkv bench serve`: what the HTTP front end costs the engine's step, N streams at a time.

The server runs in a process of its own, as `radixkv serve` does, with the model's forward
replaced by a stub that keeps a simulated device busy for `--device-ms` (a sleep, which releases
the interpreter lock as a GPU's queued work does) and returns fixed logits. So a step costs the
device time plus the engine's host work. With the core in the server's process (`in-process`),
whatever the front end does (parsing, detokenizing, stop strings, JSON, SSE framing) competes
with the step for the lock; with the core in its own process (`core-process`, `radixkv serve`'s
default) it does not. Each N runs both modes, one after the other, in the same run.

For each N (`--streams`, default 16, 32, 128, 256) and mode, in a fresh server:
- `idle_period_ms`: the median period between decode steps of N sequences submitted straight to
  the engine, before the HTTP server starts: the step with no front end attached;
- `period_ms`: the same with N streaming clients over HTTP (`/v1/completions`, `stream: true`,
  token-id prompts, greedy and `ignore_eos` as in the idle run: the same step work), measured
  while all N decode (after the last first token, before the first finish); `period_ratio` =
  period / idle period;
- `delivered_tok_s`: tokens the clients received per second over the same window, and what an
  unhindered step would deliver (N / idle period);
- `health_p99_ms`: the 99th percentile latency of `/health`, probed every 20 ms meanwhile;
- `mean_period_ms`: the window's mean step interval, which a few long steps move and the median
  does not;
- `span_tok_s` and `span_period_ms`: the same over the whole streaming span (first token received
  to last), which exists even when a slow front end delivers the last first token after the
  first finish (the window above is then empty: `period_ms` None, `delivered_tok_s` 0).

`--dashboard-poll HZ` runs each case twice in a row, without and then with a client that polls
`/dashboard/data` HZ times a second meanwhile, as an open `/dashboard` page does (4: the page's
rate); the second case has `dashboard_hz`, `dashboard_polls` and `dashboard_p99_ms` (the poll's
latency), and the report's `dashboard` lists each pair's period with the page / without.
The clients run in this process, the server in a child: the clients' own work never takes the
server's lock. Step times come from the child (`time.monotonic`, shared by both processes on
Linux), written to a file as each step ends, by whichever process steps.

`--engine-cpus` pins the process that holds the core (the core's own, or the server's when the
core runs in it) to those CPUs, and the clients and a core's front end to the others. On a
machine with few cores, processes otherwise compete for cores rather than for the interpreter
lock, which is what the two modes differ in: on a GPU host the core's process has a core of its
own. Either mode gets the whole machine, the clients always the CPUs the engine does not have.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from radixkv.interpreter import python_argv

DEFAULT_STREAMS = (16, 32, 128, 256)
MODES = {"in-process": False, "core-process": True}
PROMPT_TOKENS = 64
HEALTH_EVERY_S = 0.02
STUB_TOKEN = ord("A")
"""The token the stub always produces: the byte tokenizer's "A", one character of text."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--streams",
        type=int,
        action="append",
        help=f"concurrent streams (repeatable; default {', '.join(map(str, DEFAULT_STREAMS))})",
    )
    parser.add_argument("--device-ms", type=float, default=2.0, help="the stub device's busy time per step")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each stream generates")
    parser.add_argument(
        "--mode",
        choices=sorted(MODES),
        action="append",
        help="where the engine core runs (repeatable; default both, alternating)",
    )
    parser.add_argument(
        "--engine-cpus",
        type=_cpu_list,
        default=None,
        help="pin the core's process to these CPUs (a comma list), everything else to the others",
    )
    parser.add_argument(
        "--dashboard-poll",
        type=float,
        default=None,
        metavar="HZ",
        help="also run each case with /dashboard/data polled HZ times a second (an open page: 4)",
    )
    parser.add_argument("--json", action="store_true", help="print only a JSON object")


def run(args: argparse.Namespace) -> int:
    streams = args.streams or list(DEFAULT_STREAMS)
    if min(streams) < 1 or args.tokens < 8 or args.device_ms < 0:
        raise ValueError("--streams must be >= 1, --tokens >= 8 and --device-ms >= 0")
    if args.dashboard_poll is not None and not args.dashboard_poll > 0:
        raise ValueError(f"--dashboard-poll must be > 0, got {args.dashboard_poll}")
    polls = [None] if args.dashboard_poll is None else [None, args.dashboard_poll]
    modes = args.mode or list(MODES)
    if args.engine_cpus:
        allowed = os.sched_getaffinity(0)
        if not args.engine_cpus < allowed:
            raise ValueError(f"--engine-cpus must be some, not all, of CPUs {sorted(allowed)}")
        pin_process(allowed - args.engine_cpus)  # the clients, and the children until they move
    cases, pairs = [], []
    for n in streams:
        for mode in modes:
            pair = []
            for poll_hz in polls:
                case = measure(n, args.tokens, args.device_ms, MODES[mode], args.engine_cpus, poll_hz)
                cases.append(case)
                pair.append(case)
                if not args.json:
                    print(format_case(case), flush=True)
            if len(pair) == 2:
                pairs.append(dashboard_cost(*pair))
                if not args.json:
                    cost = pairs[-1]
                    print(
                        f"  step with the dashboard polled / without: median {_ratio(cost['period_ratio'])}, "
                        f"mean {_ratio(cost['mean_period_ratio'])}"
                    )
    if args.json:
        cpus = sorted(args.engine_cpus) if args.engine_cpus else None
        report = {"device_ms": args.device_ms, "tokens": args.tokens, "engine_cpus": cpus, "cases": cases}
        if pairs:
            report["dashboard"] = pairs
        print(json.dumps(report, indent=2))
    return 0


def dashboard_cost(without: dict[str, Any], polled: dict[str, Any]) -> dict[str, Any]:
    """What an open page cost one case: the all-decoding window's step period with it over
    without, as the median (`period_ratio`) and the mean (`mean_period_ratio`, which counts the
    steps a snapshot delays, however few) of the step intervals. Where either window is empty (a
    front end too slow to start every stream before the first ends), the median over the whole
    span instead (`measured` says which) and no mean."""

    def ratio(key: str) -> float | None:
        return polled[key] / without[key] if without[key] and polled[key] else None

    window = ratio("period_ms") is not None
    return {
        "streams": without["streams"],
        "mode": without["mode"],
        "measured": "window" if window else "span",
        "period_ratio": ratio("period_ms" if window else "span_period_ms"),
        "mean_period_ratio": ratio("mean_period_ms") if window else None,
    }


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def measure(
    streams: int,
    tokens: int,
    device_ms: float,
    engine_process: bool,
    engine_cpus: set[int] | None = None,
    poll_hz: float | None = None,
) -> dict[str, Any]:
    """One case in a fresh server child (see the module docstring), whose engine is pinned to
    `engine_cpus` when given; the clients run on this process's CPUs (`run` pins them to the
    others). With `poll_hz`, a client polls the dashboard's data that often meanwhile."""
    with tempfile.TemporaryDirectory() as folder:
        stats_path = Path(folder) / "stats.json"
        steps_path = Path(folder) / "steps.txt"
        port = _free_port()
        child = subprocess.Popen(
            python_argv(
                "-c",
                "from radixkv.tools.bench_serve import stub_server; stub_server()",
                str(port),
                str(streams),
                str(tokens),
                str(device_ms),
                str(stats_path),
                str(steps_path),
                str(int(engine_process)),
                ",".join(map(str, sorted(engine_cpus or ()))),
            ),
            stdout=subprocess.DEVNULL,
        )
        try:
            clients = asyncio.run(_clients(port, streams, tokens, child, poll_hz))
            server_cpus = sorted(os.sched_getaffinity(child.pid))
        finally:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=60)
        idle_start, idle_end = json.loads(stats_path.read_text())["idle_window"]
        all_steps = [float(line) for line in steps_path.read_text().split()]
        engine_cpus_seen = json.loads(Path(f"{steps_path}.cpus").read_text())  # written by `stub_core`
    idle = _median_interval([t for t in all_steps if idle_start <= t <= idle_end][2:])  # decode steps
    start, end = clients["decode_window"]
    steps = [t for t in all_steps if start <= t <= end]
    period = _median_interval(steps)
    mean_period = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else None
    span_period = _median_interval([t for t in all_steps if clients["span"][0] <= t <= clients["span"][1]])
    case = {
        "streams": streams,
        "mode": "core-process" if engine_process else "in-process",
        "idle_period_ms": idle * 1e3,
        "period_ms": period * 1e3 if period else None,
        "period_ratio": period / idle if period and idle else None,
        "mean_period_ms": mean_period * 1e3 if mean_period else None,
        "delivered_tok_s": clients["delivered_tok_s"],
        "unhindered_tok_s": streams / idle if idle else None,
        "health_p99_ms": clients["health_p99_s"] * 1e3,
        "span_tok_s": clients["span_tok_s"],
        "span_period_ms": span_period * 1e3 if span_period else None,
        "steps_in_window": len(steps),
        "engine_cpus": engine_cpus_seen,
        "server_cpus": server_cpus,
    }
    if poll_hz is not None:
        polls = clients["dashboard_polls"]
        case |= {
            "dashboard_hz": poll_hz,
            "dashboard_polls": len(polls),
            "dashboard_p99_ms": _percentile(polls, 99) * 1e3,
        }
    return case


def format_case(case: dict[str, Any]) -> str:
    """One line; "n/a" where the all-decoding window is empty (see the module docstring)."""
    period = delivered = "n/a"
    if case["period_ms"] is not None:
        period = f"{case['period_ms']:.2f} ms ({case['period_ratio']:.2f}x)"
        delivered = f"{case['delivered_tok_s']:,.0f}"
    span = "n/a"
    if case["span_period_ms"] is not None:
        span = f"{case['span_period_ms']:.2f} ms ({case['span_period_ms'] / case['idle_period_ms']:.2f}x)"
    page = ""
    if "dashboard_hz" in case:
        page = f"; dashboard polled {case['dashboard_polls']}x, p99 {case['dashboard_p99_ms']:.1f} ms"
    return (
        f"{case['streams']:>4} streams, {case['mode']:>12}: step {case['idle_period_ms']:.2f} ms idle, "
        f"{period} streaming; {delivered} tok/s delivered of {case['unhindered_tok_s']:,.0f}; "
        f"/health p99 {case['health_p99_ms']:.1f} ms; whole span: "
        f"{case['span_tok_s']:,.0f} tok/s, step {span}{page}"
    )


# ------------------------------------------------------------------------------ the clients


async def _clients(
    port: int, streams: int, tokens: int, child: subprocess.Popen, poll_hz: float | None = None
) -> dict[str, Any]:
    import httpx

    base = f"http://127.0.0.1:{port}"
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=120.0, limits=limits) as http:
        await _wait_healthy(http, child)
        done = asyncio.Event()
        health = asyncio.create_task(_probe(http, "/health", HEALTH_EVERY_S, done))
        page = asyncio.create_task(_probe(http, "/dashboard/data", 1 / poll_hz, done)) if poll_hz else None
        results = await asyncio.gather(*(_stream(http, i, tokens) for i in range(streams)))
        done.set()
        latencies = await health
        polls = await page if page is not None else []
    first_tokens = [r[0] for r in results]
    finishes = [r[1] for r in results]
    counts = [r[2] for r in results]
    window = (max(first_tokens), min(finishes))
    span = (min(first_tokens), max(finishes))
    received = sum(_count_between(r[3], *window) for r in results)
    seconds = window[1] - window[0]
    if sum(counts) != streams * tokens:
        raise RuntimeError(f"the clients received {sum(counts)} tokens, expected {streams * tokens}")
    return {
        "decode_window": window,
        "span": span,
        "span_tok_s": sum(counts) / (span[1] - span[0]) if span[1] > span[0] else 0.0,
        "delivered_tok_s": received / seconds if seconds > 0 else 0.0,
        "health_p99_s": _percentile(latencies, 99),
        "dashboard_polls": polls,
    }


async def _wait_healthy(http: Any, child: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"the stub server exited with {child.returncode} before it answered")
        try:
            if (await http.get("/health")).status_code == 200:
                return
        except Exception:  # not listening yet
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the stub server did not answer /health within {timeout_s:.0f} s")


async def _stream(http: Any, index: int, tokens: int) -> tuple[float, float, int, list[float]]:
    """One streaming completion: (first token time, finish time, tokens, each token's time). Every
    token is the stub's `STUB_TOKEN`, one character, so a chunk's text length is its tokens."""
    prompt = [(index * 7 + j) % 256 for j in range(PROMPT_TOKENS)]
    body = {
        "model": "stub",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    times: list[float] = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[len("data: ") :])["choices"]
                now = time.monotonic()
                times += [now] * sum(len(c["text"]) for c in choices)
    if not times:
        raise RuntimeError(f"stream {index} received no token")
    return times[0], times[-1], len(times), times


async def _probe(http: Any, path: str, every_s: float, done: asyncio.Event) -> list[float]:
    """GETs `path` every `every_s` until `done`: each answer's latency."""
    latencies = []
    while not done.is_set():
        start = time.monotonic()
        (await http.get(path)).raise_for_status()
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(every_s)
    return latencies


# ------------------------------------------------------------------------------- the server


def stub_core(streams: int, device_s: float, steps_path: str, cpus: set[int] | None, core: Any) -> None:
    """Fits the core with the stub model and a step clock (in whichever process holds it): each
    step's end is written to `steps_path`, a line as it ends. Torch gets one intra-op thread, as
    the host side of a GPU step needs no more: otherwise its idle OpenMP workers spin for the CPU
    that the front end's threads want (in either mode). With `cpus`, the process is pinned there."""
    import torch

    from radixkv.tools.bench_engine import StubModel

    torch.set_num_threads(1)
    if cpus:
        pin_process(cpus)

    runner = core.runner
    runner.model = stub = StubModel(core.vocab_size, streams * PROMPT_TOKENS, runner.device, device_s)
    stub.logits[..., STUB_TOKEN] += 1e3  # every row greedily picks it
    out = open(steps_path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    seen = False

    def clock(_core: Any) -> None:
        nonlocal seen
        out.write(f"{time.monotonic()}\n")
        if not seen:  # the first step: where the stepping thread may run, seen from inside it
            seen = True
            Path(f"{steps_path}.cpus").write_text(json.dumps(sorted(os.sched_getaffinity(0))))

    core.step_hooks.append(clock)


def stub_server() -> None:
    """The child's body: argv is port, streams, tokens, device ms, the stats and steps files'
    paths, 1 for a core in its own process, and the engine's CPUs (a comma list, or empty)."""
    port, streams, tokens = (int(a) for a in sys.argv[1:4])
    device_s, stats_path, steps_path = float(sys.argv[4]) / 1e3, Path(sys.argv[5]), sys.argv[6]
    engine_process = sys.argv[7] == "1"
    cpus = _cpu_list(sys.argv[8]) if sys.argv[8] else None
    import uvicorn

    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.sampling_params import SamplingParams
    from radixkv.server.app import build_app
    from radixkv.tools.bench_engine import stub_config

    context = PROMPT_TOKENS + tokens
    config = stub_config(streams, streams * PROMPT_TOKENS, streams * (-(-context // 16) + 1) * 2)
    setup = functools.partial(stub_core, streams, device_s, steps_path, cpus)
    engine = AsyncEngine(config, engine_process=engine_process, core_setup=setup)
    # A front end keeps the clients' CPUs, which it inherited; an engine in process has moved this
    # process to its own in `stub_core`.

    async def idle_run() -> None:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[(i * 7 + j) % 256 for j in range(PROMPT_TOKENS)] for i in range(streams)]
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    idle_start = time.monotonic()
    asyncio.run(idle_run())
    stats_path.write_text(json.dumps({"idle_window": [idle_start, time.monotonic()]}))
    app = build_app(engine, "stub", session_idle_timeout_s=None)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    os._exit(0)


# ----------------------------------------------------------------------------------- helpers


def pin_process(cpus: set[int]) -> None:
    """Pins every thread of this process to `cpus` (threads and processes started later inherit
    their starter's CPUs): `os.sched_setaffinity(0)` alone moves only the calling thread."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), cpus)


def _cpu_list(text: str) -> set[int]:
    try:
        cpus = {int(c) for c in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of CPU numbers, got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of CPU numbers, got {text!r}")
    return cpus


def _median_interval(times: list[float]) -> float | None:
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else None


def _count_between(times: list[float], start: float, end: float) -> int:
    return sum(1 for t in times if start < t <= end)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
