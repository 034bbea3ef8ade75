"""`radixkv simulate`: the prefix cache alone, no model, over a trace or a workload.

Requests are served one at a time in arrival order through the engine's own cache classes
(block pool, radix tree, eviction policy, sequence admission), so the hit rate is the one the
engine would see at that capacity with no other pressure on memory. Beside it stands the ideal
hit rate: the same requests through a cache that never evicts.

A hash-id trace request's prompt is its ids' tokens; it is cached once served, and its output
is not (the trace does not say what it was). A workload's turns arrive at the session's arrival
plus the think times before them, and each reply is a run of fresh placeholder tokens of the
turn's `max_tokens`, cached with its prompt, as the engine's own reply would be.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.eviction import POLICIES, make_policy
from radixkv.cache.kv_cache_manager import KVCacheManager
from radixkv.cache.radix_cache import RadixCache
from radixkv.conversation import Conversation
from radixkv.router import ROUTERS
from radixkv.workloads.format import Workload, read_workload
from radixkv.workloads.traces import HashIdTokens, iter_lines, read_hash_trace


@dataclass(slots=True)
class CacheRequest:
    arrival: float
    prompt: list[int]
    output: list[int]  # cached together with the prompt once the request is served


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


def requests_from_trace(path: str | Path, hash_block: int) -> list[CacheRequest]:
    tokens = HashIdTokens(hash_block)
    trace = read_hash_trace(path)
    return [CacheRequest(r.arrival_s, tokens.tokens(r.hash_ids), []) for r in trace]


def requests_from_workload(workload: Workload, tokenizer: Any | None) -> list[CacheRequest]:
    """Each turn as a request, in order of arrival; replies are fresh negative token ids, which
    no prompt can share, so only the conversation's own next turn finds them."""
    fresh = itertools.count(-1, -1)
    timed = []
    for session in workload.sessions:
        conv = Conversation(None if session.uses_ids else tokenizer, session.system)
        t = session.arrival
        for turn in session.turns:
            t += turn.think
            reply = list(itertools.islice(fresh, turn.max_tokens))
            timed.append(CacheRequest(t, conv.prompt(turn.user), reply))
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
    kv = new_cache(capacity_blocks, block_size, eviction)
    return sum(kv.serve_without_model(req.prompt, req.output) for req in requests)


def new_cache(capacity_blocks: int, block_size: int, eviction: str) -> KVCacheManager:
    pool = BlockPool(capacity_blocks, block_size)
    return KVCacheManager(pool, RadixCache(pool, make_policy(eviction)))


def ideal_hit_rate(requests: list[CacheRequest], block_size: int, eviction: str) -> float:
    """The hit rate of a cache large enough never to evict."""
    prompt_tokens = sum(len(r.prompt) for r in requests)
    blocks_for_all = sum(-(-(len(r.prompt) + len(r.output)) // block_size) for r in requests)
    return hit_tokens(requests, max(blocks_for_all, 1), block_size, eviction) / max(prompt_tokens, 1)


def simulate(
    requests: list[CacheRequest], capacities: list[int], block_size: int, eviction: str
) -> list[SimulationResult]:
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ideal = ideal_hit_rate(requests, block_size, eviction)
    results = []
    for capacity in capacities:
        start = time.perf_counter()
        hits = hit_tokens(requests, capacity, block_size, eviction)
        seconds = time.perf_counter() - start
        results.append(
            SimulationResult(
                requests=len(requests),
                prompt_tokens=prompt_tokens,
                hit_tokens=hits,
                hit_rate=hits / max(prompt_tokens, 1),
                ideal_hit_rate=ideal,
                capacity_blocks=capacity,
                block_size=block_size,
                eviction=eviction,
                tokens_per_s=prompt_tokens / seconds,
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
    parser.add_argument("--eviction", default="lru", choices=sorted(POLICIES))
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


def run(args: argparse.Namespace) -> int:
    path = Path(args.trace_or_workload)
    if is_hash_trace(path):
        requests = requests_from_trace(path, args.hash_block)
    else:
        workload = read_workload(path)
        requests = requests_from_workload(workload, workload_tokenizer(workload, args.model))
    if args.replicas is not None:
        from radixkv.tools import simulate_replicas

        return simulate_replicas.run(args, path.name, requests)
    results = simulate(requests, args.capacity_blocks, args.block_size, args.eviction)
    if args.json:
        rows = [asdict(r) for r in results]
        json.dump(rows[0] if len(rows) == 1 else rows, sys.stdout, indent=2)
        print()
        return 0
    r0 = results[0]
    print(
        f"{path.name}: {r0.requests} requests, {r0.prompt_tokens} prompt tokens, "
        f"block size {r0.block_size}, {r0.eviction}"
    )
    print(f"{'capacity (blocks)':>18} {'hit rate':>9} {'ideal':>7} {'of ideal':>9} {'tokens/s':>11}")
    for r in results:
        share = r.hit_rate / r.ideal_hit_rate if r.ideal_hit_rate else 0.0
        print(
            f"{r.capacity_blocks:>18} {r.hit_rate:>9.3f} {r.ideal_hit_rate:>7.3f} {share:>9.2f} "
            f"{r.tokens_per_s:>11,.0f}"
        )
    return 0


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
