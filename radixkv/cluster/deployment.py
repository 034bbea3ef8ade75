"""The Ray Serve application: N engine replicas behind one routing ingress.

Each replica is its own deployment (`engine-0` ... `engine-{N-1}`, one Serve replica each) so
that the router, not Serve's own load balancer, picks where a request goes: a deployment handle
sends to the one replica behind it. An `EngineReplica` runs one `AsyncEngine` and the
single-engine server's application (`radixkv.server.app.build_app`), and serves forwarded
requests through it in process (`call_asgi`), so auth, validation, errors, SSE and per-replica
`/metrics` are the server's own. Ray restarts a replica whose process dies; the ingress probes
every replica each `PROBE_PERIOD_S` and takes it back into routing when it answers.

The ingress (`RouterIngress`) is the HTTP entry point: a `RouterService` over the replicas'
handles. It builds its `Router` once every replica has answered a first probe, sized like the
replicas' caches (blocks and block size from their engines).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from radixkv.cluster.asgi_call import Forwarded, ResponseHead, call_asgi
from radixkv.cluster.router_service import ReplicaFailed, ReplicaInfo, RouterService
from radixkv.config import EngineConfig
from radixkv.router import Router
from radixkv.server.body import DEFAULT_MAX_REQUEST_BYTES
from radixkv.server.sessions import DEFAULT_IDLE_TIMEOUT_S

PROBE_PERIOD_S = 0.5
PROBE_TIMEOUT_S = 2.0
REPLICA_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


# The ingress probes each replica twice a second: those calls stay out of the access log.
@serve.deployment(
    max_ongoing_requests=1024,
    health_check_period_s=2,
    health_check_timeout_s=10,
    logging_config={"enable_access_log": False},
)
class EngineReplica:
    """`server_options`: `build_app`'s keyword arguments (keys, limits, isolation, sessions)."""

    def __init__(self, config: EngineConfig, model_name: str, server_options: dict[str, Any]):
        from radixkv import AsyncEngine
        from radixkv.server.app import build_app

        self.engine = AsyncEngine(config, engine_process=False)  # Ray supervises the replica itself
        self.app = build_app(self.engine, model_name, **server_options)
        self.info = ReplicaInfo(uuid.uuid4().hex, self.engine.metrics()["num_blocks"], config.block_size)

    def probe(self) -> ReplicaInfo:
        return self.info

    async def forward(self, request: Forwarded) -> AsyncIterator[ResponseHead | bytes]:
        async for part in call_asgi(self.app, request):
            yield part

    async def __del__(self) -> None:
        await self.engine.shutdown()


class RayReplica:
    """A `ReplicaClient` over a deployment handle; Ray's errors for a dead or unreachable replica
    become `ReplicaFailed`. Only a request the replica had accepted fails so: one it had not yet
    accepted when it died (still in the handle's own routing) is re-sent by the handle to the
    replica's restart, and waits for it, unseen by the router's retry."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def forward(self, request: Forwarded) -> AsyncIterator[ResponseHead | bytes]:
        try:
            async for part in self.handle.options(stream=True).forward.remote(request):
                yield part
        except REPLICA_ERRORS as e:
            raise ReplicaFailed(type(e).__name__) from e

    async def probe(self) -> ReplicaInfo:
        try:
            return await asyncio.wait_for(self.handle.probe.remote(), PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, *REPLICA_ERRORS) as e:
            raise ReplicaFailed(f"no answer to a probe: {type(e).__name__}") from e


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
class RouterIngress:
    """`service_options`: `RouterService`'s keyword arguments (isolation, body limit)."""

    def __init__(
        self, engines: list[DeploymentHandle], policy: str, model: str, service_options: dict[str, Any]
    ) -> None:
        from radixkv.model.loader import load_tokenizer
        from radixkv.model.tokenizer_threads import PerThreadTokenizer

        self.replicas = [RayReplica(h) for h in engines]
        self.policy = policy
        tokenizer = load_tokenizer(model)
        self.tokenizer = PerThreadTokenizer(tokenizer) if tokenizer is not None else None
        self.service_options = service_options
        self.service: RouterService | None = None
        self._started = asyncio.Lock()
        self._probing: asyncio.Task | None = None

    async def __call__(self, request: Request) -> Response:
        return await (await self._service()).handle(request)

    async def _service(self) -> RouterService:
        """The router service, built at the first request once every replica answers: its
        indexes are sized like the replicas' caches (all replicas share one engine config)."""
        if self.service is not None:
            return self.service
        async with self._started:
            if self.service is None:
                infos = await asyncio.gather(*(h.probe.remote() for h in (r.handle for r in self.replicas)))
                router = Router(self.policy, len(infos), infos[0].num_blocks, infos[0].block_size)
                self.service = RouterService(router, self.replicas, self.tokenizer, **self.service_options)
                await self.service.probe_all()
                self._probing = asyncio.ensure_future(self._probe_forever())
        return self.service

    def __del__(self) -> None:
        """Serve calls this as the replica shuts down: the probe loop ends with it."""
        if self._probing is not None:
            self._probing.cancel()

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_PERIOD_S)
            await self.service.probe_all()


def build_application(
    config: EngineConfig,
    replicas: int,
    policy: str,
    model_name: str,
    api_key: str | tuple[str, ...] | None = None,
    max_waiting: int | None = None,
    gpus_per_replica: float = 0,
    session_idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    cache_isolation: str = "shared",
) -> Any:
    """The Serve application: `replicas` engine deployments and the routing ingress. Each
    replica serves the single-engine server's application with these options (`build_app`), so
    keys, limits and cache isolation hold there as on one server; the ingress refuses a body over
    `max_request_bytes` itself and routes in each key's namespace under per-key isolation. Every
    replica closes its chat sessions idle for `session_idle_timeout_s` (0 or None: only by
    `DELETE /v1/sessions/{id}`, which the ingress sends to every replica)."""
    server_options = {
        "api_key": api_key,
        "max_waiting": max_waiting,
        "session_idle_timeout_s": session_idle_timeout_s,
        "max_request_bytes": max_request_bytes,
        "cache_isolation": cache_isolation,
    }
    engines = [
        EngineReplica.options(name=f"engine-{i}", ray_actor_options={"num_gpus": gpus_per_replica}).bind(
            config, model_name, server_options
        )
        for i in range(replicas)
    ]
    service_options = {
        "per_key_isolation": cache_isolation == "per-key" and bool(api_key),
        "max_request_bytes": max_request_bytes,
    }
    return RouterIngress.bind(engines, policy, config.model, service_options)
