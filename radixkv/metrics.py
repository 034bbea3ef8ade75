"""Engine metrics: counters, gauges and latency histograms, as a dict or Prometheus text.

Histograms keep cumulative bucket counts, as Prometheus does, so a scraper can compute rates and
quantiles; the bucket bounds follow vLLM's for the same three latencies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

_HELP = {
    "kv_cache_usage": ("gauge", "KV blocks held by running requests and the prefix cache, over all blocks"),
    "num_blocks": ("gauge", "KV blocks in the pool"),
    "num_free_blocks": ("gauge", "KV blocks free"),
    "prefix_cache_queries": ("counter", "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("counter", "prompt tokens found in the prefix cache"),
    "num_preemptions": ("counter", "requests preempted for lack of KV blocks"),
    "num_evicted_blocks": ("counter", "blocks evicted from the prefix cache"),
    "num_cow_copies": ("counter", "shared blocks copied before a write"),
    "num_host_blocks": ("gauge", "KV blocks in the host tier"),
    "num_free_host_blocks": ("gauge", "host-tier KV blocks free"),
    "host_cache_hits": ("counter", "prompt tokens loaded from the host tier instead of recomputed"),
    "num_offloaded_blocks": ("counter", "blocks written from the device to the host tier"),
    "num_loaded_blocks": ("counter", "blocks loaded from the host tier back to the device"),
    "num_swapped_out_blocks": ("counter", "blocks of preempted requests swapped out to the host tier"),
    "num_swapped_in_blocks": ("counter", "blocks of preempted requests swapped back in"),
    "store_cache_hits": ("counter", "prompt tokens fetched from the KV store instead of recomputed"),
    "kv_store_hit_blocks": ("counter", "blocks found in the KV store and fetched"),
    "kv_store_miss_blocks": ("counter", "blocks looked up in the KV store and not found"),
    "kv_store_read_bytes": ("counter", "bytes read from the KV store"),
    "kv_store_written_blocks": ("counter", "blocks written to the KV store"),
    "kv_store_written_bytes": ("counter", "bytes written to the KV store"),
    "kv_store_dropped_writes": (
        "counter",
        "blocks not written to the KV store: its queue was full or it was down",
    ),
    "kv_store_write_queue_blocks": ("gauge", "blocks waiting to be written to the KV store"),
    "kv_store_errors": ("counter", "KV store failures (each one a miss or lost writes)"),
    "kv_store_corrupt_entries": ("counter", "damaged KV store entries found (each one a miss)"),
    "running": ("gauge", "requests running"),
    "running_seqs": ("gauge", "sequences running (a request's samples or beams each count)"),
    "waiting": ("gauge", "requests waiting"),
    "open_sessions": ("gauge", "chat sessions open on the server (the session_id extra)"),
    "time_to_first_token_seconds": ("histogram", "time from submission to the first generated token"),
    "inter_token_latency_seconds": ("histogram", "time between two generated tokens of a request"),
    "e2e_request_latency_seconds": ("histogram", "time from submission to the last generated token"),
}


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def as_dict(self) -> dict:
        cumulative, running = {}, 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            cumulative[bound] = running
        return {"buckets": cumulative, "sum": self.total, "count": self.count}


def prometheus_text(metrics: dict) -> str:
    """The text exposition format (version 0.0.4), every name prefixed `radixkv_`."""
    lines = []
    for key, value in metrics.items():
        kind, help_text = _HELP[key]
        name = f"radixkv_{key}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        if kind != "histogram":
            lines.append(f"{name} {float(value)!r}")
            continue
        for bound, n in value["buckets"].items():
            lines.append(f'{name}_bucket{{le="{bound!r}"}} {n}')
        lines += [
            f'{name}_bucket{{le="+Inf"}} {value["count"]}',
            f"{name}_sum {value['sum']!r}",
            f"{name}_count {value['count']}",
        ]
    return "\n".join(lines) + "\n"


def describe(key: str) -> tuple[str, str]:
    """The Prometheus type ("counter", "gauge" or "histogram") and help text of a `metrics()` key."""
    return _HELP[key]
