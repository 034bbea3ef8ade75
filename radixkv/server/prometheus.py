"""`GET /metrics`: the engine's metrics through prometheus-client, under their `radixkv_` names.

A custom collector reads `engine.metrics()` at scrape time, so the exposition is always the
engine's own counts (no second set of counters to keep in step), typed as `radixkv.metrics`
types them: counters get the `_total` suffix, histograms their cumulative `_bucket`, `_sum` and
`_count` series. prometheus-client writes the text format, escaping included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from radixkv.metrics import describe

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    def __init__(self, read: Callable[[], dict]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        for key, value in self.read().items():
            kind, help_text = describe(key)
            name = f"radixkv_{key}"
            if kind == "counter":
                yield CounterMetricFamily(name, help_text, value=value)
            elif kind == "gauge":
                yield GaugeMetricFamily(name, help_text, value=value)
            else:
                buckets = [(repr(float(le)), n) for le, n in value["buckets"].items()]
                buckets.append(("+Inf", value["count"]))
                yield HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=value["sum"])


def exposition(read: Callable[[], dict]) -> Callable[[], bytes]:
    """A function that renders the current metrics as Prometheus text."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(read))
    return lambda: generate_latest(registry)
