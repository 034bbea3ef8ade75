"""docs/grafana/radixkv.json, the Grafana dashboard for `GET /metrics`: it imports (a Prometheus
datasource input, unique panel ids, every panel placed and queried), and every `radixkv_` name
its PromQL uses is a series a real engine exposes, so renaming a metric breaks this test rather
than leaving an empty panel.

The engine is the tiny llama of `model_folders` with a host tier and a file KV store, so the
keys that only those add are exposed too; one short generate fills the latency histograms.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixkv import Engine, SamplingParams
from radixkv.server.prometheus import exposition

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "radixkv.json"
NAME = re.compile(r"radixkv_[a-z0-9_]+")
QUANTILE = re.compile(r"histogram_quantile\(")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exposed_series(model_folders, tmp_path_factory) -> set[str]:
    """The sample names of the server's exposition, `open_sessions` added as `radixkv.server.app`
    adds it: every name, `_total`, `_bucket`, `_sum` and `_count` suffixes included."""
    store = tmp_path_factory.mktemp("kv-store")
    with Engine.from_pretrained(
        model_folders["llama"],
        block_size=4,
        kv_cache_memory="64KiB",
        host_kv_cache_memory="64KiB",
        kv_store=f"file://{store}",
    ) as engine:
        engine.generate([list(range(10))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        text = exposition(lambda: {**engine.metrics(), "open_sessions": 0})().decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def exprs(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_dashboard_imports_with_a_prometheus_datasource(dashboard):
    (source,) = dashboard["__inputs"]
    assert (source["type"], source["pluginId"]) == ("datasource", "prometheus")
    assert (dashboard["uid"], dashboard["title"]) == ("radixkv", "radixkv")
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["targets"] and all(target["expr"] for target in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${" + source["name"] + "}", panel["title"]


def test_every_metric_the_dashboard_queries_is_exposed(dashboard, exposed_series):
    used = {name for expr in exprs(dashboard) for name in NAME.findall(expr)}
    assert "radixkv_time_to_first_token_seconds_bucket" in exposed_series  # the histograms are there
    assert used, "no radixkv_ name in the dashboard"
    assert used <= exposed_series, sorted(used - exposed_series)


def test_quantiles_are_over_bucket_rates_by_le(dashboard):
    quantiles = [expr for expr in exprs(dashboard) if QUANTILE.search(expr)]
    assert len(quantiles) == 7  # TTFT p50/p90/p99, inter-token and end-to-end p50/p99
    for expr in quantiles:
        assert all(name.endswith("_bucket") for name in NAME.findall(expr)), expr
        assert "by (le)" in expr and "rate(" in expr, expr
