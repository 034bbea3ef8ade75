"""`radixkv serve --replicas N`: N engine replicas on Ray Serve behind the cache-aware router.

Without `--ray-address` a local Ray instance is started (and stopped on exit); with one, the
replicas join that cluster. Each replica asks for one GPU when the cluster has one for every
replica, else an equal share of the GPUs there are (replicas then share a device, and each sizes
its KV cache from its share: `EngineConfig.gpu_memory_share`), else none.
The HTTP API is the single-engine server's, on `--host:--port`, served by Ray Serve's proxy;
every replica takes the server's `--api-key`, `--cache-isolation`, `--max-request-bytes` and
`--max-waiting` (the router refuses an oversized body itself), closes chat sessions after
`--session-idle-timeout`, and the router sends `DELETE /v1/sessions/{id}` to all of them. Each
replica runs its engine core in its own process's thread (Ray supervises the replica), so
`--no-engine-process` changes nothing here; `--graceful-timeout` (checked, as every server option
is) does not apply either: Ray Serve shuts replicas down with its own grace period (20 s by
default).
SIGTERM or Ctrl-C shuts the application down.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
from typing import TYPE_CHECKING

from radixkv.router import ROUTERS

if TYPE_CHECKING:
    from radixkv.config import EngineConfig

PROXY_READY_CHECK_TIMEOUT_S = 60
"""Ray Serve gives a new HTTP proxy 5 s to answer its first ready check, then kills it and starts
another, and `serve.start` fails on the first one's death. A busy machine takes longer than that to
start a Ray worker (seen with both cores of the development machine busy), so a local Ray
instance started here allows a minute unless `RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S` says."""

WORKER_NICENESS = 0
"""Ray starts its workers at niceness 15, and the engine replicas are workers: beside any process
of normal priority they got about a thirtieth of its CPU share. With two busy loops on the
development machine's two cores, the killed-replica test of `tests/test_cluster.py` took 500 s
where it takes 27 s on the quiet machine. The replicas are the serving work, so a local Ray
instance started here runs its workers at normal priority."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cluster = parser.add_argument_group("replicas (needs the `cluster` extra: ray[serve])")
    cluster.add_argument("--replicas", type=int, default=None, help="engine replicas on Ray Serve")
    cluster.add_argument("--router", default="cache-aware", choices=ROUTERS, help="how requests are spread")
    cluster.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start one)")


def run(args: argparse.Namespace) -> int:
    from radixkv.server.launch import check_arguments, read_api_keys

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    check_arguments(args)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SystemExit('--replicas needs Ray Serve: pip install -e ".[cluster]"') from None
    from radixkv.tools.engine_args import engine_config

    keys = read_api_keys(args)  # checked before any replica starts
    config = engine_config(args)
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        init_local_ray(max(os.cpu_count() or 1, args.replicas + 1))
    # From ray.init on (whose own handler would end the process with status 15) a SIGTERM or
    # Ctrl-C shuts down cleanly: while the application starts, by interrupting the start (which
    # may wait for ever, for replicas that are never placed), then by ending the wait.
    stop = threading.Event()
    starting = True

    def on_signal(*_: object) -> None:
        stop.set()
        if starting:
            raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        _deploy(args, config, keys)
        starting = False
        stop.wait()
    except KeyboardInterrupt:
        pass  # stopped while starting: what has started is shut down below
    if args.ray_address:
        serve.delete("radixkv")  # the cluster and its Serve instance are not ours to stop
    else:
        serve.shutdown()
    ray.shutdown()
    return 0


def _deploy(args: argparse.Namespace, config: EngineConfig, keys: tuple[str, ...]) -> None:
    """Starts Serve and the application of `args.replicas` replicas; returns once it is up."""
    import ray
    from ray import serve

    from radixkv.cluster.deployment import build_application

    gpus = min(1.0, ray.cluster_resources().get("GPU", 0) / args.replicas)
    if 0 < gpus < 1:  # replicas share a device: each sizes its KV cache from its own part
        config = dataclasses.replace(config, gpu_memory_share=gpus)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_application(
        config,
        args.replicas,
        args.router,
        args.served_model_name or args.model,
        api_key=keys or None,
        max_waiting=args.max_waiting,
        gpus_per_replica=gpus,
        session_idle_timeout_s=args.session_idle_timeout,
        max_request_bytes=args.max_request_bytes,
        cache_isolation=args.cache_isolation,
    )
    serve.run(app, name="radixkv", route_prefix="/")
    print(
        f"radixkv serve: {args.replicas} replicas of {config.model}, {args.router} routing, "
        f"on http://{args.host}:{args.port}/v1",
        flush=True,
    )


def init_local_ray(num_cpus: int, **kwargs) -> None:
    """Starts a local Ray instance of `num_cpus` CPUs whose Serve proxy may take
    `PROXY_READY_CHECK_TIMEOUT_S` to start and whose workers run at `WORKER_NICENESS` (unless
    `RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S` or `RAY_worker_niceness` say otherwise); `kwargs` go
    to `ray.init`."""
    import ray

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_CHECK_TIMEOUT_S))
    os.environ.setdefault("RAY_worker_niceness", str(WORKER_NICENESS))
    ray.init(num_cpus=num_cpus, include_dashboard=False, **kwargs)
