"""`radixkv bench serve` end to end at a tiny size: a stub server in a child process, streaming
clients here, and a report whose figures hang together."""

from __future__ import annotations

import os

import pytest

from radixkv.tools.bench_serve import measure


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "core-process"])
def test_a_tiny_run_reports_step_periods_tokens_and_health_latency(engine_process):
    case = measure(streams=3, tokens=24, device_ms=5.0, engine_process=engine_process)
    assert case["mode"] == ("core-process" if engine_process else "in-process")
    assert case["streams"] == 3 and case["steps_in_window"] >= 2
    # Every step sleeps 5 ms in the stub: no period can be shorter.
    assert case["idle_period_ms"] >= 5.0 and case["period_ms"] >= 5.0
    assert case["period_ratio"] == pytest.approx(case["period_ms"] / case["idle_period_ms"])
    assert case["delivered_tok_s"] > 0 and case["unhindered_tok_s"] == pytest.approx(
        3 / (case["idle_period_ms"] / 1e3)
    )
    assert case["health_p99_ms"] > 0
    assert case["span_tok_s"] > 0 and case["span_period_ms"] >= 5.0


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "core-process"])
def test_engine_cpus_pin_the_stepping_thread_and_leave_the_rest_the_others(engine_process):
    """`--engine-cpus`: the thread that steps runs only on the engine's CPUs (seen from inside
    it); the server's main thread is the engine's in process, the clients' with the core apart."""
    allowed = os.sched_getaffinity(0)
    engine = {max(allowed)}
    case = measure(streams=2, tokens=16, device_ms=2.0, engine_process=engine_process, engine_cpus=engine)
    assert case["engine_cpus"] == sorted(engine)
    assert case["server_cpus"] == sorted(engine if not engine_process else allowed)
    assert os.sched_getaffinity(0) == allowed  # measure itself pins nothing here (`run` does)


@pytest.mark.slow
def test_dashboard_poll_runs_each_case_with_and_without_a_page(capsys):
    """`--dashboard-poll`: a pair of cases a setting, the second polled, and their ratio."""
    import json

    from radixkv.cli import main

    args = [
        "bench",
        "serve",
        "--streams",
        "3",
        "--tokens",
        "96",
        "--device-ms",
        "5",
        "--mode",
        "core-process",
    ]
    assert main([*args, "--dashboard-poll", "20", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    without, polled = report["cases"]
    assert "dashboard_hz" not in without and polled["dashboard_hz"] == 20
    assert polled["dashboard_polls"] >= 2 and polled["dashboard_p99_ms"] > 0  # 96 steps of 5 ms or more
    (cost,) = report["dashboard"]
    assert cost["measured"] == "window"
    assert cost["period_ratio"] == pytest.approx(polled["period_ms"] / without["period_ms"])
    assert cost["mean_period_ratio"] == pytest.approx(polled["mean_period_ms"] / without["mean_period_ms"])
    assert without["mean_period_ms"] >= 5.0
