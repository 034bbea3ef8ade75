"""The router's HTTP side: the OpenAI API in front of N replicas, each request sent by `Router`.

`RouterService.handle` takes a Starlette request and returns a response; it knows the replicas
only as `ReplicaClient`s (`forward` a request, `probe` for liveness), so it runs the same behind
Ray Serve (`radixkv.cluster.deployment`) or over replicas in this process.

Routing key: the prompt's token ids as the replica would build them before its reply splicing
(the chat template over the messages' text, or the completion prompt), from the server's own
request models, in the request's cache namespace (its `cache_salt`, and under per-key isolation
its API key: `radixkv.server.state.cache_namespace`), so that a prefix cached for one tenant never
draws another's requests. A body that does not parse is routed with no key (to the least loaded
replica), whose server answers it with the proper 400. Templates and tokenization run in worker
threads, so one long prompt never holds the router's event loop.

Hostile traffic: a body over `max_request_bytes` is a 413 at the router's door, before the router
reads more of it and before any of it reaches a replica (`radixkv.server.body`; behind Ray Serve,
its HTTP proxy may still buffer what the client sends meanwhile). So a large body without a valid
key is a 413 here where a single server answers 401 first: the replicas check keys.

Faults. A replica that fails (`ReplicaFailed`: its process died, or it is unreachable) is taken
out of routing at once, and `probe_all` brings it back when it answers again. Its prefix index
is kept unless it answers as a new process (a new `incarnation`, whose cache is empty): a replica
too busy to answer a probe in time loses its traffic for a moment, not what the router knows.
A request it was serving is retried once on another replica if nothing of the response has
reached the client yet: generation has no side effect, so the client sees only the delay. That
covers every non-streamed request (the router holds its body until it is complete) and a stream
that failed before its first byte. A stream already under way cannot be taken back; it ends
with an error event in OpenAI's shape.

Sessions. `DELETE /v1/sessions/{id}` goes to every replica in routing at once, since a session's
turns are routed by prefix and usually, not always, land on one replica: the answer is a
replica's 200 if any had the session open, else the replicas' own 404 `session_not_found`. A
replica out of routing at that moment is not asked; its copy of the session ends by its idle
timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, NamedTuple, Protocol

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixkv.cache.salt import salt_offset, salted
from radixkv.cluster.asgi_call import Forwarded, ResponseHead
from radixkv.cluster.router_metrics import RouterCounters, replica_exposition, router_exposition
from radixkv.conversation import render_chat
from radixkv.router import NoReplicaAvailable, Router
from radixkv.server.body import DEFAULT_MAX_REQUEST_BYTES, read_body
from radixkv.server.engine_inputs import prompt_batch
from radixkv.server.errors import APIError
from radixkv.server.prometheus import CONTENT_TYPE
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.state import bearer_key, cache_namespace

log = logging.getLogger("radixkv.cluster")

REPLICA_HEADER = "x-radixkv-replica"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
SESSIONS_PATH = "/v1/sessions/"
SCRAPE_TIMEOUT_S = 2.0
"""How long the router's `/metrics` waits for each replica's own: a replica that is dying or
restarting must not hold the scrape (it is left out of that one)."""


class ReplicaFailed(RuntimeError):
    """The replica cannot serve: its process died or it does not answer."""


class ReplicaInfo(NamedTuple):
    incarnation: str  # new each time the replica starts, so a restart is seen even if missed
    num_blocks: int
    block_size: int


class ReplicaClient(Protocol):
    def forward(self, request: Forwarded) -> AsyncIterator[ResponseHead | bytes]:
        """The replica's response: its head, then its body; raises `ReplicaFailed`."""

    async def probe(self) -> ReplicaInfo:
        """Raises `ReplicaFailed` unless the replica answers in time."""


class RouterService:
    """`tokenizer` may be called from several threads at once (a `PerThreadTokenizer`).
    `per_key_isolation`: the replicas give each API key a cache namespace of its own."""

    def __init__(
        self,
        router: Router,
        replicas: list[ReplicaClient],
        tokenizer: Any,
        *,
        per_key_isolation: bool = False,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.router = router
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.per_key_isolation = per_key_isolation
        self.max_request_bytes = max_request_bytes
        self.counters = RouterCounters(len(replicas))
        self.incarnations: list[str | None] = [None] * len(replicas)
        self._metrics = router_exposition(router, self.counters)

    async def handle(self, request: Request) -> Response:
        path = request.url.path
        try:
            if request.method == "POST" and path in GENERATION_PATHS:
                return await self._generate(request)
            if request.method == "GET" and path == "/v1/models":
                return await self._any_replica(request)
            if request.method == "DELETE" and path.startswith(SESSIONS_PATH):
                return await self._close_session(request)
            if request.method == "GET" and path == "/health":
                alive = sum(s.alive for s in self.router.stats)
                body = {"status": "ok" if alive else "no replica alive", "replicas_alive": alive}
                return JSONResponse(body, 200 if alive else 503)
            if request.method == "GET" and path == "/metrics":
                return Response(self._metrics() + await self._replica_metrics(), media_type=CONTENT_TYPE)
            raise APIError(404, f"no route {request.method} {path}", code="not_found")
        except APIError as e:
            return e.response()

    async def probe_all(self) -> None:
        """Asks every replica at once whether it is up; marks it alive or dead, and treats a new
        incarnation (a restart) as an empty cache."""
        answers = await asyncio.gather(*(r.probe() for r in self.replicas), return_exceptions=True)
        for i, info in enumerate(answers):
            if isinstance(info, ReplicaFailed):
                self._failed(i)
            elif isinstance(info, BaseException):
                raise info
            else:
                if self.incarnations[i] not in (None, info.incarnation):
                    self.router.restarted(i)
                self.incarnations[i] = info.incarnation
                self.router.set_alive(i, True)

    # ------------------------------------------------------------ internals

    async def _generate(self, request: Request) -> Response:
        forwarded = await self._forwarded(request)
        key = bearer_key(request.headers.get("authorization")) if self.per_key_isolation else None
        tokens = await asyncio.to_thread(self._routing_tokens, request.url.path, forwarded.body, key)
        for attempt in range(2):
            try:
                decision = self.router.choose(tokens)
            except NoReplicaAvailable as e:
                raise _unavailable(str(e)) from e
            i = decision.replica
            self.router.dispatch(decision, tokens)
            parts = self.replicas[i].forward(forwarded)
            streaming = False
            try:
                head = await anext(parts)
                if _is_stream(head):
                    streaming = True  # `_relay` ends the request from here on
                    return StreamingResponse(self._relay(i, parts), head.status, _headers(head, i))
                body = b"".join([chunk async for chunk in parts])
                return Response(body, head.status, _headers(head, i))
            except ReplicaFailed as e:
                self._failed(i)
                log.warning("replica %d failed serving %s: %s", i, request.url.path, e)
                if attempt:
                    raise APIError(
                        502,
                        f"replica {i} failed while serving the request: {e}",
                        type="server_error",
                        code="replica_failed",
                    ) from e
                self.counters.retries += 1
            finally:
                if not streaming:
                    self.router.complete(i)
                    await parts.aclose()
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _relay(self, i: int, parts: AsyncIterator[ResponseHead | bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in parts:
                yield chunk
        except ReplicaFailed as e:
            self._failed(i)
            error = APIError(
                502, f"replica {i} failed mid-stream: {e}", type="server_error", code="replica_failed"
            )
            yield f"data: {json.dumps(error.body())}\n\n".encode()
        finally:
            self.router.complete(i)
            await parts.aclose()

    async def _any_replica(self, request: Request) -> Response:
        forwarded = await self._forwarded(request)
        for i, s in enumerate(self.router.stats):
            if not s.alive:
                continue
            try:
                return await self._whole(i, forwarded)
            except ReplicaFailed:
                self._failed(i)
        raise _unavailable("no replica is alive to serve the request")

    async def _replica_metrics(self) -> bytes:
        """The live replicas' own `/metrics`, labelled by replica (`replica_exposition`). A
        replica that fails to answer within `SCRAPE_TIMEOUT_S` is left out of this scrape; the
        probes judge liveness."""
        alive = [i for i, s in enumerate(self.router.stats) if s.alive]
        scrape = Forwarded("GET", "/metrics", b"", [], b"")
        asked = (asyncio.wait_for(self._whole(i, scrape), SCRAPE_TIMEOUT_S) for i in alive)
        answers = await asyncio.gather(*asked, return_exceptions=True)
        texts = []
        for i, answer in zip(alive, answers, strict=True):
            missed = isinstance(answer, ReplicaFailed | asyncio.TimeoutError)
            if isinstance(answer, BaseException) and not missed:
                raise answer
            if isinstance(answer, Response) and answer.status_code == 200:
                texts.append((i, answer.body.decode()))
        return replica_exposition(texts)

    async def _close_session(self, request: Request) -> Response:
        """The close sent to every replica in routing: the first 200 among their answers, else
        the first replica's answer (a 404, or the error every replica gives, as a 401)."""
        forwarded = await self._forwarded(request)
        alive = [i for i, s in enumerate(self.router.stats) if s.alive]
        answers = await asyncio.gather(*(self._whole(i, forwarded) for i in alive), return_exceptions=True)
        replies = []
        for i, answer in zip(alive, answers, strict=True):
            if isinstance(answer, ReplicaFailed):
                self._failed(i)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                replies.append(answer)
        if not replies:
            raise _unavailable("no replica is alive to serve the request")
        return next((r for r in replies if r.status_code == 200), replies[0])

    async def _whole(self, i: int, forwarded: Forwarded) -> Response:
        """Replica `i`'s whole response to a request; raises `ReplicaFailed`."""
        parts = self.replicas[i].forward(forwarded)
        try:
            head = await anext(parts)
            body = b"".join([chunk async for chunk in parts])
        finally:
            await parts.aclose()
        return Response(body, head.status, _headers(head, i))

    def _failed(self, i: int) -> None:
        if self.router.stats[i].alive:
            self.counters.failures[i] += 1
        self.router.set_alive(i, False)

    async def _forwarded(self, request: Request) -> Forwarded:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        return Forwarded(
            request.method,
            request.url.path,
            request.url.query.encode(),
            headers,
            await read_body(request, self.max_request_bytes),
        )

    def _routing_tokens(self, path: str, body: bytes, key: str | None) -> list[int]:
        """The prompt's tokens as the replicas' caches key them: shifted into the request's
        cache namespace (`cache_namespace` of API key `key` and its `cache_salt`; see
        `radixkv.cache.salt`). Runs in a worker thread."""
        try:
            if path == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate_json(body)
                if self.tokenizer is None or self.tokenizer.chat_template is None:
                    return []
                messages = [{"role": m.role, "content": m.content or ""} for m in chat.messages]
                offset = salt_offset(cache_namespace(key, chat.cache_salt))
                return salted(render_chat(self.tokenizer, messages, {}), offset)
            completion = CompletionRequest.model_validate_json(body)
            prompt = prompt_batch(completion)[0]
        except (ValidationError, APIError, ValueError, IndexError):
            return []
        if not isinstance(prompt, list):
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False) if self.tokenizer else []
        return salted(prompt, salt_offset(cache_namespace(key, completion.cache_salt)))


def _unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="no_replica", headers={"Retry-After": "1"})


def _is_stream(head: ResponseHead) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in head.headers)


def _headers(head: ResponseHead, replica: int) -> dict[str, str]:
    kept = {k: v for k, v in head.headers if k.lower() not in ("content-length", "transfer-encoding")}
    kept[REPLICA_HEADER] = str(replica)
    return kept
