"""`radixkv bench engine`: its JSON is the contract's, its parts add up, and its cases are the CLI's."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from radixkv.cli import ENGINE_BENCH_CASES, main
from radixkv.tools.bench_engine import CASES, OVERLAP_CASES, OVERLAP_DEVICE_MS, PARTS


def test_cli_names_every_case_of_the_bench():
    assert (*CASES, *OVERLAP_CASES) == ENGINE_BENCH_CASES
    assert {"decode_256", "mixed_prefill", "waiting_512"} <= set(CASES)


def test_json_reports_host_ms_per_step_and_parts_that_add_up():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "engine", "--json", "--steps", "2", "--case", "waiting_64"]) == 0
    (case,) = json.loads(out.getvalue())["cases"]
    assert case["name"] == "waiting_64" and case["steps"] == 2
    assert set(case["parts"]) == set(PARTS)
    assert case["host_ms_per_step"] > 0
    assert all(v >= 0 for k, v in case["parts"].items() if k != "other")
    assert abs(sum(case["parts"].values()) - case["host_ms_per_step"]) < 1e-6


@pytest.mark.slow  # two engines of 532 MiB pools
def test_overlap_case_reports_host_device_and_period():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "engine", "--json", "--steps", "2", "--case", "overlap_decode_256"]) == 0
    (case,) = json.loads(out.getvalue())["cases"]
    assert case["name"] == "overlap_decode_256" and case["steps"] == 2
    assert case["device_ms"] >= OVERLAP_DEVICE_MS  # a sleep lasts at least what it asks
    assert case["host_ms"] > 0 and case["period_ms"] > 0
    assert case["serial_period_ms"] > case["serial_device_ms"]  # a period holds the device's busy time
