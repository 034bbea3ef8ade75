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
