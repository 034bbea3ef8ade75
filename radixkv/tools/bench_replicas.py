"""`radixkv bench replicas`: the same multi-turn replay through one engine and through N replicas.

Three runs of one workload, side by side in one command: a single engine in process
(`radixkv replay`), then N replicas on a local Ray Serve behind the cache-aware router, then the
same N replicas behind round robin, both replayed over HTTP (`radixkv replay --url`). Every
engine gets the same `--kv-cache-memory`. Cache-aware routing should find about what the single
engine finds (each conversation's turns meet their own earlier KV); round robin sends turn k+1
to a replica that did not see turn k, and finds less. With `--kv-store URL` (an empty store the
replicas share, e.g. `redis://127.0.0.1:6379/0`), a fourth run puts the same replicas behind
round robin again with that store: turn k+1 then finds turn k's blocks in the store.
"""

from __future__ import annotations

import argparse
import json
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

from radixkv.config import EngineConfig
from radixkv.tools.replay import format_report, ideal_hit_rate, replay, summarize
from radixkv.tools.simulate import workload_tokenizer
from radixkv.workloads.format import read_workload

ROUTED = ("cache-aware", "round-robin")  # without a store; `--kv-store` adds round robin over it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", type=Path, nargs="?", default=Path("workloads/chat_small.jsonl"))
    parser.add_argument("--model", default="tiny-llama", help="preset name or local Hugging Face folder")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="64MiB", help="per engine")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--speed", type=float, default=1.0, help="arrival and think times divided by this")
    parser.add_argument(
        "--kv-store",
        default=None,
        metavar="URL",
        help="an empty KV store the replicas share: adds a run behind round robin over it",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON only")


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from radixkv.cluster.deployment import build_application
    from radixkv.cluster.launch import init_local_ray
    from radixkv.tools.replay_http import Server, replay_url

    workload = read_workload(args.workload)
    config = EngineConfig(model=args.model, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory)
    tokenizer = workload_tokenizer(workload, args.model)
    runs: dict[str, Any] = {"single engine": replay(workload, config, args.speed)}
    init_local_ray(max(4, args.replicas + 1), log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        routed = [(router, config) for router in ROUTED]
        if args.kv_store is not None:
            routed.append(("round-robin", replace(config, kv_store=args.kv_store)))
        for i, (router, replica_config) in enumerate(routed):
            app = build_application(replica_config, args.replicas, router, args.model)
            serve.run(app, name=f"bench-{i}", route_prefix="/")
            server = Server(f"http://127.0.0.1:{port}/v1")
            shared = ", shared store" if replica_config.kv_store else ""
            name = f"{args.replicas} replicas, {router}{shared}"
            runs[name] = replay_url(workload, server, tokenizer, args.speed)
            serve.delete(f"bench-{i}")  # its engines stop (and flush their writes) before the next starts
    finally:
        ray.shutdown()
    report = {
        "workload": str(args.workload),
        "model": args.model,
        "config": {
            "replicas": args.replicas,
            "kv_cache_memory": args.kv_cache_memory,
            "speed": args.speed,
            "kv_store": args.kv_store,
        },
        "ideal_hit_rate": ideal_hit_rate(workload, tokenizer, args.block_size),
        "runs": {name: summarize(result) for name, result in runs.items()},
    }
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
