"""`--report-html FILE` of `radixkv replay` and `radixkv simulate`: the run's figures and tables
as one self-contained HTML file (`radixkv.dashboard.page.report_page`), drawn with the live
dashboard's charts; it opens in any browser, offline, with no server.

A replay's file: its summary table per run (and the restart's table, after a restart), TTFT's
distribution per run, the hit rate over the replay (cumulative, and each request's), and TTFT
over the replay. A simulation's: its rows as a table, hit rate and cache-op speed against
capacity per policy, and the settings `adaptive` chose over the trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixkv.cache.miniature import SETTINGS
from radixkv.dashboard.page import report_page

if TYPE_CHECKING:
    from radixkv.tools.replay_result import TurnRecord

MAX_POINTS = 2000
"""Points a series keeps (evenly spaced): a long replay's file stays small and quick to draw."""
RUN_ROWS = (
    ("requests", lambda r: r["requests"]),
    ("prompt tokens", lambda r: r["prompt_tokens"]),
    ("hit rate", lambda r: r["hit_rate"]),
    ("host hit rate", lambda r: r["host_hit_rate"]),
    ("store hit rate", lambda r: r.get("store_hit_rate", 0.0)),
    ("TTFT p50 (s)", lambda r: r["ttft_s"]["p50"]),
    ("TTFT p90 (s)", lambda r: r["ttft_s"]["p90"]),
    ("TTFT p99 (s)", lambda r: r["ttft_s"]["p99"]),
    ("TPOT p50 (s)", lambda r: r["tpot_s"]["p50"]),
    ("E2E p50 (s)", lambda r: r["e2e_s"]["p50"]),
    ("output tok/s", lambda r: r["throughput_tok_s"]),
    ("evicted blocks", lambda r: r["evicted_blocks"]),
    ("preemptions", lambda r: r["preemptions"]),
    ("failed requests", lambda r: r["failed_requests"]),
)


def write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(report_page(data), encoding="utf-8")


def thin(points: list[list[float]]) -> list[list[float]]:
    """At most `MAX_POINTS` of `points`, evenly spaced, the last one kept."""
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / MAX_POINTS
    return [points[int(i * step)] for i in range(MAX_POINTS - 1)] + [points[-1]]


def replay_report(report: dict[str, Any], runs: dict[str, list[TurnRecord]]) -> dict[str, Any]:
    """The page data of a replay: `report` as `replay.build_report` makes it, `runs` its records."""
    names = list(report.get("runs", {}))
    tables = [
        {
            "title": "Runs",
            "columns": ["", *names],
            "rows": [[label, *(get(report["runs"][n]) for n in names)] for label, get in RUN_ROWS],
        }
    ]
    restart = report.get("restart")
    if restart is not None:
        arms = [arm for arm in ("store", "cold", "none") if restart.get(arm)]
        tables.insert(
            0,
            {
                "title": f"Restart after turn {restart['after_turn']}: the turns after it",
                "columns": ["arm", "turns", "TTFT p50 (s)", "TTFT p90 (s)", "hit rate"],
                "rows": [
                    [a, *(restart[a][k] for k in ("turns", "ttft_p50_s", "ttft_p90_s", "hit_rate"))]
                    for a in arms
                ],
            },
        )
    cdf, hits, ttft = [], [], []
    for name, records in runs.items():
        times = sorted(r.ttft_s for r in records)
        cdf.append({"name": name, "points": thin([[t, (i + 1) / len(times)] for i, t in enumerate(times)])})
        ordered = sorted(records, key=lambda r: r.due_s)
        cached = prompt = 0
        cumulative = []
        for r in ordered:
            cached, prompt = cached + r.cached_tokens, prompt + r.prompt_tokens
            cumulative.append([r.due_s, cached / prompt if prompt else 0.0])
        hits.append({"name": f"{name}, cumulative", "points": thin(cumulative)})
        ttft.append({"name": name, "points": thin([[r.due_s, r.ttft_s] for r in ordered]), "dots": True})
    if runs:
        name, first = next(iter(runs.items()))
        each = [[r.due_s, r.cached_tokens / r.prompt_tokens] for r in sorted(first, key=lambda r: r.due_s)]
        hits.append({"name": f"{name}, each request", "points": thin(each), "dots": True})
    arrival = "arrival (s from the start)"
    return {
        "title": f"replay of {Path(report['workload']).name}",
        "subtitle": f"on {report['model']}",
        "tables": tables,
        "figures": [
            {"title": "TTFT distribution", "kind": "line", "series": cdf, "opts": {"xLabel": "seconds"}},
            {
                "title": "Prompt tokens found in the cache",
                "kind": "line",
                "series": hits,
                "opts": {"yMin": 0, "yMax": 1, "xLabel": arrival},
            },
            {"title": "TTFT over the replay", "kind": "line", "series": ttft, "opts": {"xLabel": arrival}},
        ],
    }


def simulate_report(name: str, results: list[Any]) -> dict[str, Any]:
    """The page data of a simulation of `name` (a trace or workload file): `results` are
    `SimulationResult`s, or with `--replicas` `ReplicaSimulationResult`s (a series per router and
    policy, no speed: the replicas' cache ops are not timed)."""
    replicas = hasattr(results[0], "router")

    def series_of(r: Any) -> str:
        return f"{r.router}, {r.eviction}" if replicas else r.eviction

    by_series: dict[str, list[Any]] = {}
    for r in sorted(results, key=lambda r: r.capacity_blocks):
        by_series.setdefault(series_of(r), []).append(r)

    def against_capacity(value: Any) -> list[dict[str, Any]]:
        return [
            {"name": k, "points": [[r.capacity_blocks, value(r)] for r in rs]} for k, rs in by_series.items()
        ]

    capacity = "capacity (blocks" + (" per replica)" if replicas else ")")
    columns = [capacity, "router, eviction" if replicas else "eviction", "hit rate", "of ideal"]
    columns.append("imbalance" if replicas else "tokens/s")
    rows = [
        [
            r.capacity_blocks,
            series_of(r),
            r.hit_rate,
            r.hit_rate / r.ideal_hit_rate if r.ideal_hit_rate else None,
            r.imbalance if replicas else r.tokens_per_s,
        ]
        for r in results
    ]
    figures = [
        {
            "title": "Hit rate against capacity",
            "kind": "line",
            "series": against_capacity(lambda r: r.hit_rate),
            "opts": {"yMin": 0, "xLabel": capacity},
        }
    ]
    if not replicas:
        figures.append(
            {
                "title": "Cache-op speed against capacity (prompt tokens / s)",
                "kind": "line",
                "series": against_capacity(lambda r: r.tokens_per_s),
                "opts": {"xLabel": capacity},
            }
        )
    chosen = [
        {"name": f"{r.capacity_blocks} blocks", "points": thin(steps(r.trajectory))}
        for r in results
        if getattr(r, "trajectory", ())
    ]
    if chosen:
        figures.append(
            {
                "title": "The settings adaptive chose",
                "kind": "line",
                "series": chosen,
                "opts": {"xLabel": "request", "yMin": 0, "yMax": len(SETTINGS) - 1},
                "note": "setting: " + ", ".join(f"{i} {s.name}" for i, s in enumerate(SETTINGS)),
                "wide": True,
            }
        )
    r0 = results[0]
    subtitle = f"{r0.requests} requests, {r0.prompt_tokens} prompt tokens, block size {r0.block_size}"
    if replicas:
        subtitle += f", {r0.replicas} replicas"
    return {
        "title": f"simulation of {name}",
        "subtitle": subtitle,
        "tables": [{"title": "Runs", "columns": columns, "rows": rows}],
        "figures": figures,
    }


def steps(trajectory: tuple[tuple[int, str], ...]) -> list[list[float]]:
    """`adaptive`'s (tree clock, setting) choices as a step line over requests (the clock counts
    a match and an insert per request), the setting as its index in `SETTINGS`."""
    order = [s.name for s in SETTINGS]
    points: list[list[float]] = []
    for clock, setting in trajectory:
        if points:
            points.append([clock // 2, points[-1][1]])
        points.append([clock // 2, order.index(setting)])
    return points
