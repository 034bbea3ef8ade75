"""`radixkv simulate`: the prefix cache alone, no model, over a trace or a workload.

Requests are served one at a time in arrival order through the engine's own cache classes
(block pool, radix tree, eviction policy, sequence admission), so the hit rate is the one the
engine would see at that capacity with no other pressure on memory. Beside it stands the ideal
hit rate: the same requests through a cache that never evicts.

A hash-id trace request's prompt is its ids' tokens; it is cached once served, and its output
is not (the trace does not say what it was). A workload's turns arrive at the session's arrival
plus the think times before them, and each reply is a run of fresh placeholder tokens of the
turn's `max_tokens`, cached with its prompt, as the engine's own reply would be.

With `--store-blocks N`, a KV store of N blocks (least recently used out first) stands behind
the cache: every full block cached is written to it, and a match that runs out continues with
the consecutive blocks the store holds, as in the engine (`radixkv.kvstore`). Replicas share one
store (`simulate_replicas`).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from radixkv.cache.block_pool import BlockPool, OutOfBlocks
from radixkv.cache.eviction import POLICIES, Adaptive, make_policy
from radixkv.cache.host_tier import HostTier
from radixkv.cache.kv_cache_manager import NO_DATA, KVCacheManager
from radixkv.cache.offline_optimal import OfflineOptimal
from radixkv.cache.radix_cache import RadixCache
from radixkv.conversation import Conversation
from radixkv.kvstore import KeySpace, MemoryBackend, StoredBlock, StoredRun
from radixkv.router import ROUTERS
from radixkv.tools import report_html
from radixkv.workloads.format import Workload, read_workload
from radixkv.workloads.traces import HashIdTokens, iter_lines, read_hash_trace


@dataclass(slots=True)
class CacheRequest:
    arrival: float
    prompt: list[int]
    output: list[int]  # cached together with the prompt once the request is served
    session: str | None = None  # the chat session it is a turn of
    closes_session: bool = False  # the session's last turn: it closes once this is served


@dataclass(slots=True)
class SimulationResult:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    ideal_hit_rate: float
    capacity_blocks: int
    block_size: int
    eviction: str
    tokens_per_s: float  # prompt tokens matched and inserted per second, this cache's speed
    host_blocks: int | None = None  # with a host tier
    host_hit_tokens: int | None = None  # the part of hit_tokens loaded from the host tier
    trajectory: tuple[tuple[int, str], ...] = ()  # `adaptive`: (tree clock, setting chosen)
    store_blocks: int | None = None  # with a KV store
    store_hit_tokens: int | None = None  # the part of hit_tokens fetched from the store

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "trajectory"}


class Hits(NamedTuple):
    tokens: int  # prompt tokens found in the cache
    host_tokens: int  # of them, those loaded back from the host tier
    store_tokens: int = 0  # of them, those fetched from the KV store
    trajectory: tuple[tuple[int, str], ...] = ()  # the `adaptive` policy's settings


class SimulatedStore:
    """The KV store without data: an LRU of `capacity` block keys that every cache serving
    through it shares. It is the block mover of those caches (saves put keys; the rest moves
    nothing) and answers their lookups at once."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.backend = MemoryBackend(capacity)
        self.keyspace = KeySpace("simulate", "none", block_size)

    def run(self, kv: KVCacheManager, prompt: list[int]) -> StoredRun:
        """The stored blocks that continue the cache's match of `prompt` (as admission sees it)."""
        tokens = prompt[:-1]
        keys = self.keyspace.block_keys(tokens, len(tokens))
        start = kv.cache.cached_prefix_len(tokens) // self.keyspace.block_size
        present = self.backend.exists(keys[start:])
        n = next((i for i, p in enumerate(present) if not p), len(present))
        self.backend.get(keys[start : start + n])  # read: recently used
        return StoredRun(start, [StoredBlock(b"") for _ in range(n)])

    def save(self, src: list[int], keys: list[bytes]) -> None:
        self.backend.put([(k, b"") for k in keys])

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        pass

    def offload(self, src: list[int], dst: list[int]) -> None:
        pass

    def load(self, src: list[int], dst: list[int]) -> None:
        pass

    def fetch(self, src: list[StoredBlock], dst: list[int]) -> None:
        pass


def requests_from_trace(path: str | Path, hash_block: int) -> list[CacheRequest]:
    """The trace's requests in file order; a request with a session id is that session's turn,
    and the session closes after its last request."""
    tokens = HashIdTokens(hash_block)
    trace = read_hash_trace(path)
    last = {r.session: i for i, r in enumerate(trace) if r.session is not None}
    return [
        CacheRequest(r.arrival_s, tokens.tokens(r.hash_ids), [], r.session, last.get(r.session) == i)
        for i, r in enumerate(trace)
    ]


def requests_from_workload(workload: Workload, tokenizer: Any | None) -> list[CacheRequest]:
    """Each turn as a request, in order of arrival; replies are fresh negative token ids, which
    no prompt can share, so only the conversation's own next turn finds them."""
    fresh = itertools.count(-1, -1)
    timed = []
    for session in workload.sessions:
        conv = Conversation(None if session.uses_ids else tokenizer, session.system)
        t = session.arrival
        for k, turn in enumerate(session.turns):
            t += turn.think
            reply = list(itertools.islice(fresh, turn.max_tokens))
            closes = k == len(session.turns) - 1
            timed.append(CacheRequest(t, conv.prompt(turn.user), reply, session.name, closes))
            conv.add_reply(reply)
    return sorted(timed, key=lambda r: r.arrival)


def workload_tokenizer(workload: Workload, model: str) -> Any | None:
    """The model's tokenizer when the workload has text sessions (None for all-id workloads)."""
    if all(s.uses_ids for s in workload.sessions):
        return None
    from radixkv.model.loader import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer, so it cannot read text workloads")
    return tokenizer


def is_hash_trace(path: str | Path) -> bool:
    for line in iter_lines(Path(path)):
        if line.strip():
            return "hash_ids" in json.loads(line)
    return False


def hit_tokens(requests: list[CacheRequest], capacity_blocks: int, block_size: int, eviction: str) -> int:
    """Prompt tokens the cache finds, serving `requests` in order at this capacity."""
    return cache_hits(requests, capacity_blocks, block_size, eviction).tokens


def cache_hits(
    requests: list[CacheRequest],
    capacity_blocks: int,
    block_size: int,
    eviction: str,
    host_blocks: int | None = None,
    write_through: bool = False,
    store_blocks: int | None = None,
) -> Hits:
    """Prompt tokens the cache finds, serving `requests` in order at this capacity, with a host
    tier of `host_blocks` and a KV store of `store_blocks` behind it when given."""
    pool = BlockPool(capacity_blocks, block_size)
    host = HostTier(host_blocks, block_size, write_through=write_through) if host_blocks is not None else None
    store = SimulatedStore(store_blocks, block_size) if store_blocks is not None else None
    keys = store.keyspace if store is not None else None
    if eviction == OfflineOptimal.name:
        oracle = OfflineOptimal([r.prompt for r in requests], block_size)
        return serve(KVCacheManager(pool, RadixCache(pool, oracle, host, keys)), requests, oracle, store)
    cache = RadixCache(pool, make_policy(eviction), host, keys)
    return serve(KVCacheManager(pool, cache), requests, None, store)


def serve(
    kv: KVCacheManager,
    requests: list[CacheRequest],
    oracle: OfflineOptimal | None = None,
    store: SimulatedStore | None = None,
) -> Hits:
    """Serves `requests` one at a time through `kv`, as the engine would; returns the prompt
    tokens found in the cache. The offline `oracle`, when given, learns each request's index.
    With a `store` (which `kv`'s cache keys its blocks for), matches continue there."""
    hits = host_hits = store_hits = 0
    mover = store if store is not None else NO_DATA
    for i, req in enumerate(requests):
        if oracle is not None:
            oracle.advance(i)
        stored = store.run(kv, req.prompt) if store is not None and len(req.prompt) > 1 else None
        table = kv.admit(req.prompt, session=req.session, stored=stored)
        hits += table.num_tokens
        host_hits += table.num_loaded_tokens
        store_hits += table.num_stored_tokens
        tokens = req.prompt + req.output
        try:
            kv.reserve([(table, len(tokens) - table.num_tokens)])
        except OutOfBlocks:  # longer than the whole cache: served, but not cached
            kv.release(table)
        else:
            kv.run_transfers(mover)
            kv.cache_finished(table, tokens)
        if req.closes_session:
            kv.close_session(req.session)
    kv.run_transfers(mover)
    policy = kv.cache.policy
    trajectory = tuple(policy.trajectory) if isinstance(policy, Adaptive) else ()
    return Hits(hits, host_hits, store_hits, trajectory)


def ideal_hit_rate(requests: list[CacheRequest], block_size: int) -> float:
    """The hit rate of a cache large enough never to evict."""
    prompt_tokens = sum(len(r.prompt) for r in requests)
    blocks_for_all = sum(-(-(len(r.prompt) + len(r.output)) // block_size) for r in requests)
    return hit_tokens(requests, max(blocks_for_all, 1), block_size, "lru") / max(prompt_tokens, 1)


def simulate(
    requests: list[CacheRequest],
    capacities: list[int],
    block_size: int,
    evictions: list[str],
    host_blocks: int | None = None,
    write_through: bool = False,
    store_blocks: int | None = None,
) -> list[SimulationResult]:
    """One result per capacity and policy, capacities outer, policies in the order given; with
    `host_blocks`, each capacity has a host tier of that many blocks behind it, and with
    `store_blocks` a KV store of that many blocks behind both."""
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ideal = ideal_hit_rate(requests, block_size)
    results = []
    for capacity, eviction in itertools.product(capacities, evictions):
        gc.collect()  # the previous run's tree, so that its teardown is not timed here
        start = time.perf_counter()
        hits = cache_hits(requests, capacity, block_size, eviction, host_blocks, write_through, store_blocks)
        seconds = time.perf_counter() - start
        results.append(
            SimulationResult(
                requests=len(requests),
                prompt_tokens=prompt_tokens,
                hit_tokens=hits.tokens,
                hit_rate=hits.tokens / max(prompt_tokens, 1),
                ideal_hit_rate=ideal,
                capacity_blocks=capacity,
                block_size=block_size,
                eviction=eviction,
                tokens_per_s=prompt_tokens / seconds,
                host_blocks=host_blocks,
                host_hit_tokens=hits.host_tokens if host_blocks is not None else None,
                trajectory=hits.trajectory,
                store_blocks=store_blocks,
                store_hit_tokens=hits.store_tokens if store_blocks is not None else None,
            )
        )
    return results


# ------------------------------------------------------------------ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace_or_workload", help="a hash-id trace (Mooncake style) or a workload file")
    parser.add_argument(
        "--capacity-blocks",
        required=True,
        type=_capacities,
        help="cache size in blocks, or a comma-separated sweep like 1000,4000,16000",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--eviction",
        default=["lru"],
        type=_evictions,
        help=f"eviction policies to compare, comma-separated: {', '.join(EVICTIONS)}",
    )
    parser.add_argument(
        "--host-blocks", type=_positive_blocks, help="a host tier of this many blocks behind each capacity"
    )
    parser.add_argument(
        "--write-through", action="store_true", help="copy blocks to the host tier as they are cached"
    )
    parser.add_argument(
        "--store-blocks",
        type=_positive_blocks,
        help="a KV store of this many blocks behind the cache (shared by --replicas)",
    )
    parser.add_argument("--hash-block", type=int, default=512, help="tokens per hash id of a trace")
    parser.add_argument("--model", default="tiny-llama", help="tokenizer for text workloads")
    parser.add_argument("--replicas", type=int, help="simulate N replica caches behind a router")
    parser.add_argument(
        "--router",
        type=_routers,
        default=["cache-aware"],
        help=f"with --replicas: one or more of {','.join(ROUTERS)}, comma-separated",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--report-html", type=Path, help="write the results as one self-contained HTML page of plots here"
    )
    parser.add_argument(
        "--trajectory",
        type=Path,
        help="write the settings the adaptive policy chose over time here (JSONL, one line per capacity)",
    )


def read_requests(path: Path, hash_block: int, model: str) -> list[CacheRequest]:
    """The requests of a hash-id trace or a workload file (tokenized with `model`'s tokenizer)."""
    if is_hash_trace(path):
        return requests_from_trace(path, hash_block)
    workload = read_workload(path)
    return requests_from_workload(workload, workload_tokenizer(workload, model))


def run(args: argparse.Namespace) -> int:
    """`radixkv simulate` on one cache; with `--replicas` the command runs `simulate_replicas.run`."""
    path = Path(args.trace_or_workload)
    requests = read_requests(path, args.hash_block, args.model)
    if args.write_through and args.host_blocks is None:
        raise SystemExit("--write-through needs --host-blocks")
    results = simulate(
        requests,
        args.capacity_blocks,
        args.block_size,
        args.eviction,
        args.host_blocks,
        args.write_through,
        args.store_blocks,
    )
    if args.trajectory is not None:
        write_trajectories(args.trajectory, results)
    if args.report_html is not None:
        report_html.write(args.report_html, report_html.simulate_report(path.name, results))
    if args.json:
        rows = [r.as_json() for r in results]
        json.dump(rows[0] if len(rows) == 1 else rows, sys.stdout, indent=2)
        print()
        return 0
    print_table(path.name, results)
    return 0


def write_trajectories(path: Path, results: list[SimulationResult]) -> None:
    """One JSON line per `adaptive` run: its capacity, and the settings it chose as `[request,
    setting]` pairs (the tree's clock counts a match and an insert per request)."""
    with path.open("w", encoding="utf-8") as f:
        for r in results:
            if r.eviction == Adaptive.name:
                chosen = [[clock // 2, setting] for clock, setting in r.trajectory]
                row = {"capacity_blocks": r.capacity_blocks, "settings": chosen}
                f.write(json.dumps(row) + "\n")


def print_table(name: str, results: list[SimulationResult]) -> None:
    """One line per capacity and policy; `of optimal` when `optimal` ran at that capacity."""
    r0 = results[0]
    print(f"{name}: {r0.requests} requests, {r0.prompt_tokens} prompt tokens, block size {r0.block_size}")
    if r0.host_blocks is not None:
        print(f"host tier: {r0.host_blocks} blocks behind each capacity")
    if r0.store_blocks is not None:
        print(f"KV store: {r0.store_blocks} blocks behind each capacity")
    optimal = {r.capacity_blocks: r.hit_rate for r in results if r.eviction == OfflineOptimal.name}
    head = f"{'capacity (blocks)':>18} {'eviction':>9} {'hit rate':>9}"
    head += f" {'device':>7} {'host':>7}" if r0.host_blocks is not None else ""
    head += f" {'store':>7}" if r0.store_blocks is not None else ""
    head += f" {'ideal':>7} {'of ideal':>9}"
    print(head + (f" {'of optimal':>11}" if optimal else "") + f" {'tokens/s':>11}")
    for r in results:
        line = f"{r.capacity_blocks:>18} {r.eviction:>9} {r.hit_rate:>9.4f} "
        store = (r.store_hit_tokens or 0) / max(r.prompt_tokens, 1)
        if r.host_hit_tokens is not None:
            host = r.host_hit_tokens / max(r.prompt_tokens, 1)
            line += f"{r.hit_rate - host - store:>7.4f} {host:>7.4f} "
        if r.store_hit_tokens is not None:
            line += f"{store:>7.4f} "
        line += f"{r.ideal_hit_rate:>7.3f} {_share(r.hit_rate, r.ideal_hit_rate):>9.2f}"
        if optimal:
            best = optimal.get(r.capacity_blocks)
            line += f" {_share(r.hit_rate, best):>11.2f}" if best is not None else f" {'':>11}"
        print(line + f" {r.tokens_per_s:>11,.0f}")


def _share(value: float, whole: float) -> float:
    return value / whole if whole else 0.0


EVICTIONS = [*POLICIES, OfflineOptimal.name]


def _evictions(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",")]
    bad = [n for n in names if n not in EVICTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"eviction must be among {', '.join(EVICTIONS)}, got {text!r}")
    return names


def _positive_blocks(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of blocks, got {text!r}")
    return value


def _capacities(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected block counts like 1000,4000, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"capacities must be >= 1 block, got {text!r}")
    return values


def _routers(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in ROUTERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown router {unknown[0]!r}; choose from {', '.join(ROUTERS)}")
    return names
