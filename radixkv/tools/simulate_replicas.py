"""`radixkv simulate --replicas N --router R[,R...]`: the prefix cache alone across N replicas.

Each replica is its own cache of `--capacity-blocks` blocks, served through the same per-request
step as the single-cache simulation (`simulate.serve`). A `Router` picks the
replica for each request, in arrival order, from its own estimate of the replicas' caches (its
`PrefixIndex`es), exactly as the server's router does; the hit rate counts what the chosen
replica's real cache finds.

Requests are served one at a time here, so none would ever be in flight together. To give the
load checks something to see, each request counts as in flight until `IN_FLIGHT_PER_REPLICA x N`
later requests have been routed: a steady `IN_FLIGHT_PER_REPLICA` requests per replica, like a
small engine's running batch. `imbalance` is the busiest replica's requests / the mean.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from radixkv.cache import BlockPool, KVCacheManager, RadixCache, make_policy
from radixkv.cache.offline_optimal import OfflineOptimal
from radixkv.router import Router
from radixkv.tools import report_html
from radixkv.tools.simulate import CacheRequest, Hits, SimulatedStore, ideal_hit_rate, read_requests, serve

IN_FLIGHT_PER_REPLICA = 8


@dataclass(slots=True)
class ReplicaSimulationResult:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    ideal_hit_rate: float
    capacity_blocks: int  # per replica
    block_size: int
    eviction: str
    replicas: int
    router: str
    imbalance: float  # busiest replica's requests / mean requests per replica
    requests_per_replica: list[int]
    store_blocks: int | None = None  # a KV store of this many blocks, shared by the replicas
    store_hit_tokens: int | None = None  # the part of hit_tokens fetched from the store


def replica_hit_tokens(
    requests: list[CacheRequest],
    replicas: int,
    router: str,
    capacity_blocks: int,
    block_size: int,
    eviction: str,
    store_blocks: int | None = None,
) -> tuple[Hits, Router]:
    """Prompt tokens found routing `requests` by `router` (with a KV store of `store_blocks`
    that every replica shares), and the router with its counts."""
    store = SimulatedStore(store_blocks, block_size) if store_blocks is not None else None
    keys = store.keyspace if store is not None else None
    pools = [BlockPool(capacity_blocks, block_size) for _ in range(replicas)]
    caches = [KVCacheManager(pool, RadixCache(pool, make_policy(eviction), None, keys)) for pool in pools]
    routing = Router(router, replicas, capacity_blocks, block_size, eviction=eviction)
    in_flight: deque[tuple[int, list[int]]] = deque()
    hits = store_hits = 0
    for req in requests:
        decision = routing.choose(req.prompt)
        served = serve(caches[decision.replica], [req], None, store)
        hits += served.tokens
        store_hits += served.store_tokens
        routing.dispatch(decision, req.prompt)
        in_flight.append((decision.replica, req.prompt + req.output))
        if len(in_flight) > IN_FLIGHT_PER_REPLICA * replicas:
            routing.complete(*in_flight.popleft())
    return Hits(hits, 0, store_hits), routing


def simulate_replicas(
    requests: list[CacheRequest],
    replicas: int,
    routers: list[str],
    capacities: list[int],
    block_size: int,
    evictions: list[str],
    store_blocks: int | None = None,
) -> list[ReplicaSimulationResult]:
    """One result per capacity, eviction policy and router, in that nesting; with a KV store
    of `store_blocks` that the replicas share."""
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ideal = ideal_hit_rate(requests, block_size)
    results = []
    for capacity, eviction, router in itertools.product(capacities, evictions, routers):
        hits, routing = replica_hit_tokens(
            requests, replicas, router, capacity, block_size, eviction, store_blocks
        )
        results.append(
            ReplicaSimulationResult(
                requests=len(requests),
                prompt_tokens=prompt_tokens,
                hit_tokens=hits.tokens,
                hit_rate=hits.tokens / max(prompt_tokens, 1),
                ideal_hit_rate=ideal,
                capacity_blocks=capacity,
                block_size=block_size,
                eviction=eviction,
                replicas=replicas,
                router=router,
                imbalance=routing.imbalance(),
                requests_per_replica=[s.requests for s in routing.stats],
                store_blocks=store_blocks,
                store_hit_tokens=hits.store_tokens if store_blocks is not None else None,
            )
        )
    return results


def print_table(name: str, results: list[ReplicaSimulationResult]) -> None:
    r0 = results[0]
    print(
        f"{name}: {r0.requests} requests, {r0.prompt_tokens} prompt tokens, block size {r0.block_size}, "
        f"{r0.replicas} replicas"
    )
    head = f"{'router':>12} {'blocks/replica':>15} {'eviction':>9} {'hit rate':>9} {'ideal':>7}"
    if r0.store_blocks is not None:
        print(f"KV store: {r0.store_blocks} blocks, shared by the replicas")
    print(head + f" {'imbalance':>10}" + (f" {'store':>7}" if r0.store_blocks is not None else ""))
    for r in results:
        store = ""
        if r.store_hit_tokens is not None:
            store = f" {r.store_hit_tokens / max(r.prompt_tokens, 1):>7.3f}"
        print(
            f"{r.router:>12} {r.capacity_blocks:>15} {r.eviction:>9} {r.hit_rate:>9.3f} "
            f"{r.ideal_hit_rate:>7.3f} {r.imbalance:>10.3f}{store}"
        )


def run(args: argparse.Namespace) -> int:
    """`radixkv simulate --replicas N` (the arguments are `simulate.add_arguments`')."""
    if args.replicas < 1:
        raise SystemExit(f"--replicas must be >= 1, got {args.replicas}")
    if args.host_blocks is not None or OfflineOptimal.name in args.eviction:
        # the host tier is per engine and the offline oracle needs each replica's future requests,
        # which depend on the routing: neither is modelled across replicas
        raise SystemExit("--replicas takes online eviction policies and no --host-blocks")
    path = Path(args.trace_or_workload)
    requests = read_requests(path, args.hash_block, args.model)
    results = simulate_replicas(
        requests,
        args.replicas,
        args.router,
        args.capacity_blocks,
        args.block_size,
        args.eviction,
        args.store_blocks,
    )
    if args.report_html is not None:
        report_html.write(args.report_html, report_html.simulate_report(path.name, results))
    if args.json:
        rows = [{k: v for k, v in asdict(r).items() if v is not None} for r in results]
        json.dump(rows[0] if len(rows) == 1 else rows, sys.stdout, indent=2)
        print()
    else:
        print_table(path.name, results)
    return 0
