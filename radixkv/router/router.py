"""A stateful router over N replicas: their prefix indexes, loads and liveness around `route`.

The caller reports what happens to each request: `dispatch` when it is sent (the prompt is
recorded in the replica's index and its load rises), `complete` when it ends, with the reply's
tokens when it has them (the load falls, and the whole sequence is recorded), `set_alive` when
a replica dies or comes back (a dead replica leaves routing), and `restarted` when it is a new
process (its index is cleared, as its cache is empty). `stats` is what `/metrics` shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.router.policy import ROUTERS, ReplicaView, RouteDecision, RouterConfig, route
from radixkv.router.prefix_index import PrefixIndex


@dataclass(slots=True)
class ReplicaStats:
    """Per-replica counters: `load` is in flight; the rest count since start."""

    alive: bool = True
    load: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    estimated_hit_tokens: int = 0  # the index's matched prefix at each routing decision


class Router:
    def __init__(
        self,
        policy: str,
        num_replicas: int,
        capacity_blocks: int,
        block_size: int,
        config: RouterConfig | None = None,
        eviction: str = "lru",
    ) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {num_replicas}")
        self.policy = policy
        self.config = config or RouterConfig()
        self.indexes = [PrefixIndex(capacity_blocks, block_size, eviction) for _ in range(num_replicas)]
        self.stats = [ReplicaStats() for _ in range(num_replicas)]
        self._turn = 0

    def choose(self, tokens: list[int]) -> RouteDecision:
        """The replica for `tokens`; changes nothing until `dispatch`."""
        views = [
            ReplicaView(index.match(tokens) if s.alive else 0, s.load, s.alive)
            for index, s in zip(self.indexes, self.stats, strict=True)
        ]
        return route(self.policy, len(tokens), views, self._turn, self.config)

    def dispatch(self, decision: RouteDecision, tokens: list[int]) -> None:
        s = self.stats[decision.replica]
        s.load += 1
        s.requests += 1
        s.prompt_tokens += len(tokens)
        s.estimated_hit_tokens += decision.matched_tokens
        self.indexes[decision.replica].record(tokens)
        self._turn += 1

    def complete(self, replica: int, sequence: list[int] | None = None) -> None:
        """A request on `replica` ended; `sequence` (prompt and reply tokens), when given, is
        recorded as the replica's cache now holds it."""
        s = self.stats[replica]
        s.load = max(0, s.load - 1)
        if sequence and s.alive:
            self.indexes[replica].record(sequence)

    def set_alive(self, replica: int, alive: bool) -> None:
        """Takes a replica out of routing or back in. Its index and load stay: a replica found
        unresponsive may be busy, not dead, and its requests still end through `complete`."""
        self.stats[replica].alive = alive

    def restarted(self, replica: int) -> None:
        """The replica came back as a new process: its cache, and so its index, starts empty."""
        self.indexes[replica].clear()

    def imbalance(self) -> float:
        """Busiest replica's requests / the mean over replicas (1.0 is perfectly even)."""
        counts = [s.requests for s in self.stats]
        mean = sum(counts) / len(counts)
        return max(counts) / mean if mean else 1.0
