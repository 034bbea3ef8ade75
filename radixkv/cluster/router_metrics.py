"""The router's `/metrics`: per-replica liveness, load and routed-hit estimates, Prometheus text.

Read at scrape time from the `Router`'s own per-replica stats (no second set of counts), under
`radixkv_router_` names with a `replica` label: `alive` and `in_flight` gauges; `requests`,
`prompt_tokens`, `estimated_hit_tokens` (the prefix the router's index expected the replica to
hold, summed over the requests it routed there) and `failures` counters; and one `retries`
counter. estimated_hit_tokens / prompt_tokens is the routed-hit estimate to set beside each
replica's own `radixkv_prefix_cache_hits_total`.

After them come the replicas' own engine metrics, read from each live replica's `/metrics` at
the scrape (`replica_exposition`), every sample labelled with its `replica`: so a scrape of the
router (and `radixkv replay --url` at the router, which sums over labels) sees the replicas'
prefix, host and store hits, preemptions and latencies without reaching each replica itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from radixkv.router import Router


@dataclass
class RouterCounters:
    """What the router counts beside `Router.stats`: failures seen per replica, retries made."""

    num_replicas: int
    retries: int = 0
    failures: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.failures = [0] * self.num_replicas


class RouterCollector(Collector):
    def __init__(self, router: Router, counters: RouterCounters) -> None:
        self.router = router
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        stats = self.router.stats
        gauges = {
            "alive": ("1 while the replica is in routing", [int(s.alive) for s in stats]),
            "in_flight": ("requests the router has sent it that have not ended", [s.load for s in stats]),
        }
        counters = {
            "requests": ("requests routed to the replica", [s.requests for s in stats]),
            "prompt_tokens": ("prompt tokens routed to the replica", [s.prompt_tokens for s in stats]),
            "estimated_hit_tokens": (
                "prompt tokens the router estimated the replica had cached",
                [s.estimated_hit_tokens for s in stats],
            ),
            "failures": ("times the replica was found dead or unreachable", self.counters.failures),
        }
        for kinds, family in ((gauges, GaugeMetricFamily), (counters, CounterMetricFamily)):
            for name, (help_text, values) in kinds.items():
                metric = family(f"radixkv_router_{name}", help_text, labels=["replica"])
                for i, value in enumerate(values):
                    metric.add_metric([str(i)], value)
                yield metric
        yield CounterMetricFamily(
            "radixkv_router_retries", "requests retried on another replica", value=self.counters.retries
        )


def router_exposition(router: Router, counters: RouterCounters) -> Callable[[], bytes]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router, counters))
    return lambda: generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def replica_exposition(texts: list[tuple[int, str]]) -> bytes:
    """The replicas' expositions `(replica, text)` as one, each sample given a `replica` label:
    a family that several replicas report is one family, with a sample per replica. A text that
    does not parse is left out whole (one replica's answer never breaks the router's scrape)."""
    families: dict[str, Metric] = {}
    for replica, text in texts:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": str(replica)}, sample.value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)
