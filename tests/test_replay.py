"""`radixkv replay` end to end on a tiny workload: the report's shape (docs/cli.md) and sense."""

from __future__ import annotations

import json
import random

import pytest

from radixkv.cli import main
from radixkv.workloads.format import Session, Turn, write_workload

STATS = {"mean", "p50", "p90", "p99"}
RUN_FIELDS = {
    "requests": int,
    "prompt_tokens": int,
    "cached_tokens": int,
    "hit_rate": float,
    "output_tokens": int,
    "wall_s": float,
    "throughput_tok_s": float,
    "ttft_s": dict,
    "tpot_s": dict,
    "e2e_s": dict,
    "kv_usage_peak": float,
    "kv_utilization": float,
    "preemptions": int,
    "evicted_blocks": int,
    "cow_copies": int,
    "host_hit_rate": float,
    "failed_requests": int,
    "store_hit_rate": float,
}


def validate_report(report: dict) -> None:
    assert {"workload", "model", "config", "ideal_hit_rate", "runs"} <= report.keys()
    assert 0.0 <= report["ideal_hit_rate"] <= 1.0
    for run in report["runs"].values():
        for field, kind in RUN_FIELDS.items():
            assert isinstance(run[field], kind) or (kind is float and isinstance(run[field], int)), field
        for field in ("ttft_s", "tpot_s", "e2e_s"):
            assert set(run[field]) == STATS
            assert 0 <= run[field]["p50"] <= run[field]["p99"]
        assert run["hit_rate"] == pytest.approx(run["cached_tokens"] / run["prompt_tokens"])


def replay_args(workload, model_folders, *extra: str) -> list[str]:
    return [
        "replay",
        str(workload),
        "--model",
        str(model_folders["llama"]),
        "--compare",
        "--block-size",
        "4",
        "--kv-cache-memory",
        "4MiB",
        "--speed",
        "4",
        *extra,
    ]


@pytest.fixture
def workload(tmp_path):
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(40)]
    sessions = [
        Session(
            f"s{i}",
            [Turn([rng.randrange(256) for _ in range(6)], 4, think=0.01 * k) for k in range(3)],
            arrival=0.02 * i,
            system=system,
        )
        for i in range(4)
    ]
    path = tmp_path / "tiny.jsonl"
    write_workload(path, sessions, {"generator": "test"})
    return path


def test_replay_compare_writes_a_valid_report(model_folders, workload, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    args = replay_args(workload, model_folders, "--report", str(report_path))
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "TTFT with / without the prefix cache" in printed
    report = json.loads(report_path.read_text())
    validate_report(report)
    on, off = report["runs"]["prefix_cache"], report["runs"]["no_prefix_cache"]
    assert on["requests"] == off["requests"] == 12
    assert on["prompt_tokens"] == off["prompt_tokens"]  # greedy replies: the same prompts in both runs
    assert off["cached_tokens"] == 0
    # The later turns and sessions find the shared system prompt and the earlier conversation.
    assert 0.5 < on["hit_rate"] <= report["ideal_hit_rate"] + 1e-9
    assert 0 < on["kv_utilization"] <= 1


@pytest.mark.slow
def test_replay_compares_a_squeezed_pool_with_and_without_a_host_tier(model_folders, workload, tmp_path):
    report_path = tmp_path / "report.json"
    args = replay_args(workload, model_folders, "--report", str(report_path))
    args[args.index("4MiB")] = "48KiB"  # 24 blocks of 4 tokens: the sessions evict each other
    args.remove("--compare")
    assert main([*args, "--host-kv-cache-memory", "1MiB", "--compare-host-tier"]) == 0
    report = json.loads(report_path.read_text())
    validate_report(report)
    two, one = report["runs"]["prefix_cache"], report["runs"]["no_host_tier"]
    assert one["host_hit_rate"] == 0 < two["host_hit_rate"] <= two["hit_rate"]
    assert one["hit_rate"] < two["hit_rate"] <= report["ideal_hit_rate"] + 1e-9
    assert report["config"]["host_kv_cache_memory"] == "1MiB"


@pytest.mark.slow
def test_a_restarted_replay_over_one_kv_store_finds_the_last_runs_blocks(model_folders, workload, tmp_path):
    reports = []
    store = f"file://{tmp_path}/store"
    for k in range(2):
        report_path = tmp_path / f"report{k}.json"
        args = replay_args(workload, model_folders, "--report", str(report_path), "--kv-store", store)
        args.remove("--compare")
        assert main(args) == 0
        reports.append(json.loads(report_path.read_text()))
        validate_report(reports[-1])
    cold, warm = (r["runs"]["prefix_cache"] for r in reports)
    assert cold["store_hit_rate"] == 0 < warm["store_hit_rate"] <= warm["hit_rate"]
    assert warm["hit_rate"] > cold["hit_rate"]  # the first turns of the first sessions hit too
    assert warm["prompt_tokens"] == cold["prompt_tokens"]  # the same greedy replies


def test_replay_plot_is_written(model_folders, workload, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "ttft.png"
    args = replay_args(workload, model_folders, "--plot", str(plot), "--json")
    assert main(args) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_workload_fails_before_anything_runs(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "a", "turns": [{"user_ids": [1], "max_tokens": 0}]}\n')
    assert main(["replay", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def grouped_chats(path, groups: int = 3, per_group: int = 2) -> None:
    """chat_small in miniature: every system prompt starts with the same 8 tokens, and each group
    adds 32 of its own; the sessions arrive alternating between groups, 3 turns each."""
    rng = random.Random(1)
    common = [rng.randrange(256) for _ in range(8)]
    prefixes = [common + [rng.randrange(256) for _ in range(32)] for _ in range(groups)]
    sessions = [
        Session(
            f"g{i % groups}.s{i}",
            [Turn([rng.randrange(256) for _ in range(4)], 4, think=0.0) for _ in range(3)],
            arrival=0.0,
            system=prefixes[i % groups],
        )
        for i in range(groups * per_group)
    ]
    write_workload(path, sessions, {"generator": "test"})


@pytest.mark.slow
def test_a_host_tier_restores_the_hit_rate_that_a_squeezed_pool_loses(model_folders, tmp_path):
    """The README's host-tier replay in miniature: served first come first served, each request
    follows one of another group, so a pool too small for the three group prefixes (18 blocks of
    4 tokens against 26) loses them under LRU; a host tier keeps them and loads them back."""
    workload, report_path = tmp_path / "groups.jsonl", tmp_path / "report.json"
    grouped_chats(workload)
    args = replay_args(workload, model_folders, "--report", str(report_path), "--scheduling", "fcfs")
    args[args.index("4MiB")] = "36KiB"  # 18 blocks of 4 tokens
    args.remove("--compare")
    assert main([*args, "--host-kv-cache-memory", "1MiB", "--compare-host-tier"]) == 0
    report = json.loads(report_path.read_text())
    ideal = report["ideal_hit_rate"]
    two, one = report["runs"]["prefix_cache"], report["runs"]["no_host_tier"]
    assert one["hit_rate"] < 0.6 * ideal
    assert two["hit_rate"] >= 0.95 * ideal


def test_a_replay_whose_request_fails_reports_it_and_finishes(model_folders):
    """A step that fails one session's turn ends that session there; the replay goes on with the
    others and counts the failure, instead of waiting for the failed request for ever."""
    from radixkv import Engine, EngineConfig
    from radixkv.tools.replay import replay_engine, summarize
    from radixkv.workloads.format import Workload

    poison = 255
    sessions = [
        Session("bad", [Turn([poison, 9], max_tokens=3)] * 3, system=[7, 8]),
        Session("ok", [Turn([4, 5], max_tokens=3)] * 2, arrival=5.0, system=[1, 2, 3]),  # after the fault
    ]
    engine = Engine(EngineConfig(model=str(model_folders["llama"]), block_size=4, kv_cache_memory="4MiB"))
    forward = engine.runner.forward

    def faulty(chunks):
        if any(poison in c.token_ids for c in chunks):
            raise RuntimeError("injected")
        return forward(chunks)

    engine.runner.forward = faulty
    result = replay_engine(engine, Workload(sessions, {}), speed=100.0, progress=False)
    run = summarize(result)
    assert run["failed_requests"] == 1 and result.failed[0].startswith("bad turn 0")
    turns = sorted((r.session, r.turn) for r in result.records)
    assert turns == [("ok", 0), ("ok", 1)]
    engine.check_invariants()


def test_a_run_in_which_every_turn_failed_is_reported_and_says_why(model_folders, capsys):
    """`--compare` with every turn of the run without the cache failing: the text report prints
    (its TTFT ratio `n/a`, not a division by zero) and stderr names the first failure."""
    import argparse

    from radixkv import Engine, EngineConfig
    from radixkv.tools.replay import build_report, emit, replay_engine
    from radixkv.workloads.format import Workload

    workload = Workload([Session("s", [Turn([4, 5], max_tokens=2)] * 2, system=[1, 2, 3])], {})
    runs = {}
    for name, fails in (("prefix_cache", False), ("no_prefix_cache", True)):
        engine = Engine(EngineConfig(model=str(model_folders["llama"]), block_size=4, kv_cache_memory="4MiB"))
        if fails:
            engine.runner.forward = lambda chunks: (_ for _ in ()).throw(RuntimeError("injected"))
        with engine:
            runs[name] = replay_engine(engine, workload, speed=100.0, progress=False)
    args = argparse.Namespace(workload="w.jsonl", report=None, plot=None, report_html=None, json=False)
    emit(args, build_report(args, "llama", {}, runs, ideal_hit_rate=0.5), runs)
    out, err = capsys.readouterr()
    assert "TTFT with / without the prefix cache: p50 n/a, mean n/a" in out
    assert "no_prefix_cache: 1 requests failed, the first: s turn 0:" in err and "injected" in err
