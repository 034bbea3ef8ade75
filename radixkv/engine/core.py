"""The one engine core under `Engine` (blocking calls) and `AsyncEngine` (asyncio).

One step reads top to bottom: queued submissions and aborts are applied, the scheduler picks the
batch (admitting, growing, preempting), the pending block copies run, the model runs one forward
pass over the paged KV cache, and the scheduler turns the logits into tokens, finishing and
caching what is done.

Threads. Submission (`submit`, `add_request`) never takes the step lock: a request is validated
in the caller's thread and put on an inbox that the next step drains, so a caller never waits
for the forward in flight. Everything else that touches requests, tables or the cache runs under
the step lock, in whichever thread steps. `abort(wait=False)` only queues the abort; the default
waits for the step in flight (if any) and then frees the request's blocks before returning.

Failures. An exception anywhere in a step fails the requests of that step's batch and no other:
their tables are released uncached (their reserved slots were never computed, or not known to
be), pending copies are dropped, and each gets a `RequestError` chained to the cause. The engine
stays usable and `check_invariants()` holds. A `BaseException` (KeyboardInterrupt) is contained
the same way and then re-raised.

A request ends in exactly one place, with status FINISHED: done ("stop"/"length"), aborted
("abort") or failed (`Request.error`). `on_update` hears of every request a step advanced or
ended, in the stepping thread, under the step lock.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from radixkv.cache.block_pool import BlockPool, num_blocks_for_budget, parse_bytes
from radixkv.cache.eviction import make_policy
from radixkv.cache.host_tier import HostTier
from radixkv.cache.kv_cache_manager import BlockTable, KVCacheManager
from radixkv.cache.kv_groups import kv_groups
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.salt import salt_offset, salted
from radixkv.config import EngineConfig
from radixkv.dashboard.cache_view import cache_view
from radixkv.engine.input_processor import InputProcessor, Params, Prompt
from radixkv.engine.metrics import EngineMetrics
from radixkv.engine.output_processor import beam_output, result_of, sample_output, stream_deltas
from radixkv.engine.overlap import OverlapStepper
from radixkv.errors import RequestError
from radixkv.kvstore import KeySpace, KVStore, open_backend
from radixkv.metrics import prometheus_text
from radixkv.model.loader import load_model
from radixkv.model.memory_profile import kv_cache_budget
from radixkv.model.parallel_runner import ParallelRunner
from radixkv.model.runner import ModelRunner, kv_block_bytes
from radixkv.model.stored_kv import model_fingerprint
from radixkv.model.tokenizer_threads import PerThreadTokenizer
from radixkv.outputs import Beam, RequestOutput, StreamDelta
from radixkv.scheduler.request import Request, Sequence, Status
from radixkv.scheduler.scheduler import ScheduledSeq, Scheduler
from radixkv.structured.grammar import GrammarCompiler

STORE_QUEUE_BYTES = 256 * 2**20


class EngineCore:
    STORE_POLL_S = 0.02  # an idle step's wait for the store, between looks at the inbox

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible run to run
        # Tensor parallelism: the runner starts the other ranks and holds rank 0's shard.
        parallel = ParallelRunner(config) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config, parallel)
        except BaseException:
            if parallel is not None:
                parallel.close()
            raise

    def _build(self, config: EngineConfig, parallel: ParallelRunner | None) -> None:
        if parallel is not None:
            self.model = parallel.model
        else:
            self.model = load_model(config.model, dtype=config.dtype, device=config.device, seed=config.seed)
        tokenizer = self.model.tokenizer  # used by callers' threads and the stepping thread at once
        self.tokenizer = PerThreadTokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids: list[int] = list(self.model.eos_token_ids)
        self.vocab_size: int = self.model.vocab_size
        self.max_model_len = self.model.max_model_len
        if config.max_model_len is not None:
            if config.max_model_len > self.max_model_len:
                raise ValueError(
                    f"max_model_len {config.max_model_len} exceeds the model's {self.max_model_len}"
                )
            self.max_model_len = config.max_model_len
        m = self.model
        host_bytes = parse_bytes(config.host_kv_cache_memory, "host_kv_cache_memory", allow_zero=True)
        # A block holds one KV group's layers. The host tier, the KV store and tensor-parallel
        # ranks move whole blocks of every layer, so with any of them every layer keeps every
        # block (one group, the kernel still masking each window), as for a model of one window.
        split = not (host_bytes or config.kv_store is not None or parallel is not None)
        self.groups = kv_groups(m.layer_windows, split)
        grouped = self.groups if self.groups.num_groups > 1 else None
        layers = self.groups.layers_per_group
        per_block = kv_block_bytes(
            layers, config.block_size, m.num_kv_heads, m.head_dim, m.dtype, config.kv_cache_dtype
        )
        profile = parallel.kv_cache_budget if parallel is not None else kv_cache_budget  # all ranks profile
        budget = config.kv_cache_memory or profile(
            m, block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, gpu_memory_utilization=config.gpu_memory_utilization,
            gpu_memory_share=config.gpu_memory_share,
            cuda_graph_max_seqs=0 if config.enforce_eager or parallel is not None else config.max_num_seqs,
        )
        self.pool = BlockPool(num_blocks_for_budget(budget, per_block), config.block_size)
        host = None
        if host_bytes:
            num_host = num_blocks_for_budget(config.host_kv_cache_memory, per_block, "host_kv_cache_memory")
            host = HostTier(num_host, config.block_size, write_through=config.host_write_through)
        self.store = self._open_store(config, per_block)
        cache = None
        if config.enable_prefix_cache:
            keys = self.store.keyspace if self.store is not None else None
            cache = RadixCache(self.pool, make_policy(config.eviction), host, keys)
        self.kv = KVCacheManager(self.pool, cache, config.preemption_mode, grouped)
        num_host = host.pool.num_blocks if host else 0
        self.runner: ModelRunner | ParallelRunner
        if parallel is not None:  # CUDA graphs stay off: a captured step would hold the all-reduces
            parallel.allocate(self.pool.num_blocks, config.block_size, num_host)
            self.runner = parallel
        else:
            graph_seqs = 0 if config.enforce_eager else config.max_num_seqs
            self.runner = ModelRunner(
                m, self.pool.num_blocks, config.block_size, num_host, cuda_graph_max_seqs=graph_seqs,
                groups=self.groups, kv_cache_dtype=config.kv_cache_dtype,
            )
            self.runner.store = self.store
        self.inputs = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, config.max_num_seqs,
            self.pool.num_blocks, config.block_size, self.runner.device,
            windows=self.kv.windows, max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.scheduler = Scheduler(
            self.kv,
            eos_token_ids=m.eos_token_ids,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling,
            store=self.store,
            vocab_size=self.vocab_size,
        )
        self._requests: dict[str, Request] = {}  # submitted and not yet handed back
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._stops: deque[tuple[str, int]] = deque()
        self._closed_sessions: deque[str] = deque()
        self._lock = threading.RLock()  # the step lock
        self._submit_lock = threading.Lock()  # makes a request id's check and claim one act; never held long
        self.stats = EngineMetrics()
        self.step_hooks: list[Callable[[Any], None]] = []  # called after every step, failed ones too
        self.on_submit: Callable[[], None] | None = None  # a submission or abort is queued
        self.on_update: Callable[[list[Request]], None] | None = None  # requests advanced or ended
        self.num_steps = 0  # steps that ran a batch
        self._overlap = OverlapStepper(self) if config.overlap else None

    def _open_store(self, config: EngineConfig, block_bytes: int) -> KVStore | None:
        """The KV store of `config.kv_store`, keyed for this model, dtype, KV cache dtype and block
        size (an int8 block's bytes are not a float one's)."""
        if config.kv_store is None:
            return None
        dtype = str(self.model.dtype).removeprefix("torch.")
        if config.kv_cache_dtype != "auto":
            dtype = f"{dtype}/kv-{config.kv_cache_dtype}"
        keys = KeySpace(model_fingerprint(self.model, config.seed), dtype, config.block_size)
        # A write queue of at most STORE_QUEUE_BYTES of host memory (and at least 16 blocks).
        pending = max(16, STORE_QUEUE_BYTES // block_bytes)
        backend = open_backend(config.kv_store)
        return KVStore(backend, keys, block_bytes, pending, url=config.kv_store)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler over this model's tokenizer, made on first use (reading
        a large vocabulary takes about a second). ValueError for a model without a fast one."""
        if self.model.tokenizer is None:
            raise ValueError("structured output needs a model with a tokenizer")
        return GrammarCompiler(self.model.tokenizer, self.vocab_size, self.eos_token_ids)

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> Any:
        """An engine for a local Hugging Face folder; keyword arguments are `EngineConfig` fields."""
        return cls(EngineConfig(model=str(path), **kwargs))

    # ------------------------------------------------------------- submission

    def make_request(
        self,
        prompt: Prompt,
        params: Params | None,
        request_id: str | None = None,
        *,
        call: str = "add_request",
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A validated request, not yet queued. `call` names the API: `generate` and `stream`
        take SamplingParams only, `beam_search` BeamSearchParams only (TypeError otherwise).
        Bad input raises ValueError naming the field, before any work. `session_id` makes it
        a turn of that chat session: what it caches ranks with the session under the `session`
        eviction policy until `close_session`. `cache_salt` gives it a cache namespace: it shares
        cached blocks only with requests of the same salt (`radixkv.cache.salt`); without one,
        with every other unsalted request."""
        request = self.inputs.make_request(
            prompt, params, request_id, call=call, session_id=session_id, cache_salt=cache_salt,
            in_use=self._requests,
        )
        spec = getattr(request.params, "structured_outputs", None)
        if spec is not None:  # the matcher lives where the sampler runs: in the core
            request.seqs[0].grammar = self.grammars.matcher(spec)
        return request

    def submit(self, requests: list[Request]) -> list[str]:
        """Queues requests for the next step; returns their ids. Never waits for a step."""
        with self._submit_lock:
            taken = next((r.request_id for r in requests if r.request_id in self._requests), None)
            if taken is not None:
                raise ValueError(f"request_id {taken!r} is already in use")
            for request in requests:
                if self.store is not None and len(request.prompt_ids) > 1:  # keyed as the cache keys it
                    keys = salted(request.prompt_ids[:-1], salt_offset(request.cache_salt))
                    request.store_lookup = self.store.lookup(keys)
                self._requests[request.request_id] = request
                self._inbox.append(request)
        if self.on_submit is not None:
            self.on_submit()
        return [r.request_id for r in requests]

    def add_request(
        self,
        prompt: Prompt,
        params: Params | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validates and queues a request; returns its id."""
        request = self.make_request(prompt, params, request_id, session_id=session_id, cache_salt=cache_salt)
        return self.submit([request])[0]

    def close_session(self, session_id: str, *, wait: bool = True) -> None:
        """The chat session has no more turns: under the `session` policy its cached blocks lose
        their rank over one-off requests' (a later turn with the same id revives it, and so does
        the admission of one of its turns still waiting). With `wait` (the default) that is done
        when this returns; without, before the next step schedules anything, as `abort` does."""
        self._queue(self._closed_sessions, session_id, wait)

    def abort(self, request_id: str, *, wait: bool = True) -> None:
        """Ends a request wherever it is (queued, prefilling, decoding, a beam group, the forks of
        n > 1): its computed KV is cached, its tables and locks released, its unfinished
        samples end with finish_reason "abort". With `wait` (the default) that is done when this
        returns; without, the next step does it. Unknown or finished requests are ignored."""
        self._queue(self._aborts, request_id, wait)

    def stop_sample(self, request_id: str, index: int, *, wait: bool = True) -> None:
        """A stop string found outside the core (the front end of a core in its own process,
        which detokenizes) ended sample `index` of a sampling request: the sample finishes with
        finish_reason "stop" at its next token, and the request at once, its computed KV cached,
        once every sample still running has been stopped so. `wait` as in `abort`. Unknown or
        finished requests and samples are ignored."""
        self._queue(self._stops, (request_id, index), wait)

    def _queue(self, queue: deque, item: Any, wait: bool) -> None:
        """Queues an abort, a stop or a session close for the next drain: at once, under the step
        lock, with `wait`; else the next step does it (`on_submit` wakes an idle loop)."""
        queue.append(item)
        if wait:
            with self._lock:
                self._notify(self._drain())
        elif self.on_submit is not None:
            self.on_submit()

    # ---------------------------------------------------------------- stepping

    def step(self) -> list[Request]:
        """Runs one engine step; returns the requests that made progress (new tokens or done).
        Requests the step failed are not among them: their callers get a RequestError. With
        `EngineConfig.overlap` a step submits the next batch and returns the tokens of the one
        before (`radixkv.engine.overlap`)."""
        if self._overlap is not None:
            return self._overlap.step()
        with self._lock:
            ended = self._drain()
            batch: list[ScheduledSeq] = []
            touched: list[Request] = []
            try:
                batch = self.scheduler.schedule()
                while not batch and self.scheduler.waits_for_store:  # nothing else to do: wait
                    self.store.wait(self.STORE_POLL_S)
                    ended += self._drain()
                    batch = self.scheduler.schedule()
                if batch:
                    self.num_steps += 1
                    self.kv.run_transfers(self.runner)
                    logits = self.runner.forward(batch)  # a ScheduledSeq is the runner's SequenceChunk
                    touched, failed = self.scheduler.postprocess(batch, logits)
                    ended += self._fail_each(failed)
            except Exception as exc:  # contained: the batch's requests get it
                ended += self._fail(self._step_requests(batch), exc)
            except BaseException as exc:
                self._notify(ended + self._fail(self._step_requests(batch), exc))
                raise
            return self._end_step(touched, ended)

    def _end_step(self, touched: list[Request], ended: list[Request]) -> list[Request]:
        """A step's last acts, under the step lock: metrics, hooks, `on_update`; returns `touched`."""
        self.stats.observe(touched)
        for hook in self.step_hooks:
            hook(self)
        self._notify(ended + touched)
        return touched

    def close(self) -> None:
        """Releases everything the engine holds (idempotent): requests still going are aborted;
        with a KV store, every block cached so far is written to it first (the pending saves,
        then the store's write queue), so a restart finds them; then the KV cache's device and
        host memory and the CUDA graphs are freed and tensor-parallel workers stopped. Later
        requests fail in their first step."""
        try:
            with self._lock:
                if self._overlap is not None:
                    self._overlap.close()
                for request_id in list(self._requests):
                    if self._requests[request_id].status is not Status.FINISHED:
                        self._aborts.append(request_id)
                self._notify(self._drain())
                if self.store is not None:
                    self.kv.run_transfers(self.runner)
                    self.runner.finish_loads()
        finally:
            self.scheduler.close()
            if self.store is not None:
                self.store.close()
            self.runner.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def has_work(self) -> bool:
        """Whether a step would do anything: requests queued, waiting or running, aborts, stops or
        sessions to close."""
        in_flight = self._overlap is not None and self._overlap.in_flight is not None
        queued = self._inbox or self._aborts or self._stops or self._closed_sessions
        return bool(queued or self.scheduler.has_work() or in_flight)

    def has_unfinished_requests(self) -> bool:
        return self.has_work()

    def fail_waiting(self, cause: BaseException) -> None:
        """Fails every waiting request (the engine cannot schedule them)."""
        with self._lock:
            self._notify(self._fail(list(self.scheduler.waiting), cause))

    # ----------------------------------------------------------------- results

    def is_finished(self, request_id: str) -> bool:
        return self._requests[request_id].status is Status.FINISHED

    def output(self, request_id: str) -> RequestOutput:
        """The output of a finished sampling request (and forgets the request). Raises the
        request's RequestError if a step failed it."""
        return sample_output(self.take(request_id))

    def beam_output(self, request_id: str) -> list[Beam]:
        """The beams of a finished beam-search request, best first (and forgets the request).
        An aborted search returns no beams."""
        return beam_output(self.take(request_id), self.decode)

    def result(self, request_id: str) -> RequestOutput | list[Beam]:
        """`output` or `beam_output`, as the request is."""
        return self.result_of(self.take(request_id))

    def take(self, request_id: str) -> Request:
        """Forgets a finished request and returns it, for `result_of`; raises its RequestError if
        a step failed it."""
        request = self._requests.pop(request_id)
        if request.error is not None:
            raise request.error
        return request

    def result_of(self, request: Request) -> RequestOutput | list[Beam]:
        """The output or beams of a finished request already taken (`take`). Needs no step lock:
        no step touches a finished request, so the texts can be made in the reader's thread."""
        return result_of(request, self.decode)

    def forget(self, request_id: str) -> None:
        """Drops a request's record, aborting it first if it is still going."""
        request = self._requests.get(request_id)
        if request is not None and request.status is not Status.FINISHED:
            self.abort(request_id)
        self._requests.pop(request_id, None)

    def stream_deltas(
        self, request: Request, seq: Sequence, start: int, end: int, finished: bool
    ) -> list[StreamDelta]:
        """See `radixkv.engine.output_processor.stream_deltas`."""
        return stream_deltas(request, seq, start, end, finished)

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens left out ("" for a model without a tokenizer)."""
        return self.inputs.decode(ids)

    # ---------------------------------------------------------------- metrics

    def metrics(self) -> dict:
        """Counters, gauges and latency histograms (`radixkv.engine.metrics`)."""
        return self.stats.snapshot(self.pool, self.kv, self.scheduler, self.store, len(self._inbox))

    def metrics_text(self) -> str:
        """The metrics in Prometheus' text exposition format."""
        return prometheus_text(self.metrics())

    def dashboard(self, namespaces: list[int] | None = None) -> dict:
        """What `/dashboard` shows, built between steps (`radixkv.dashboard.cache_view`)."""
        with self._lock:
            return cache_view(self, namespaces)

    def check_invariants(self) -> None:
        """Every block, reference and lock accounted for, and every live table held by a running
        sequence (see `KVCacheManager.check_invariants`). Waits for the step in flight."""
        with self._lock:
            self.kv.check_invariants(self.live_tables())

    def live_tables(self) -> list[BlockTable]:
        """The block tables of the running sequences."""
        return [s.table for r in self.scheduler.running for s in r.seqs if s.table is not None]

    # ---------------------------------------------------------------- internals

    def _drain(self) -> list[Request]:
        """Applies queued submissions, then queued aborts and stops, then sessions closed;
        returns the requests they ended."""
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        ended = []
        while self._aborts:
            request = self._requests.get(self._aborts.popleft())
            if request is not None and request.status is not Status.FINISHED:
                ended.append(self._end_now(request, "abort"))
        while self._stops:
            request_id, index = self._stops.popleft()
            request = self._requests.get(request_id)
            if request is None or request.status is Status.FINISHED or request.is_beam_search:
                continue
            for seq in request.seqs:
                seq.stop_requested |= seq.index == index
            if request.seqs and all(seq.stop_requested for seq in request.seqs):
                ended.append(self._end_now(request, "stop"))
                self.stats.observe([request])  # finished, as a step's own are (an abort is not)
        while self._closed_sessions:
            self.kv.close_session(self._closed_sessions.popleft())
        return ended

    def _end_now(self, request: Request, reason: str) -> Request:
        """Ends a request wherever it is: its computed KV cached, its tables and locks released,
        its unfinished samples ending with `reason` (an ended beam search keeps no beams)."""
        for seq in request.seqs:  # all but the slots of a step in flight are computed
            if seq.table is not None:
                self.kv.cache_finished(seq.table, seq.tokens, seq.num_computed)
        self.scheduler.remove(request)
        if not request.is_beam_search:
            for seq in request.seqs:
                request.finish_seq(seq, reason)
        self._end(request)
        return request

    def _step_requests(self, batch: list[ScheduledSeq]) -> list[Request]:
        """The requests a failed step touched: its batch's, or, when scheduling itself failed,
        every request that holds blocks."""
        if batch:
            return list({id(item.request): item.request for item in batch}.values())
        holding = [r for r in self.scheduler.waiting if any(s.table is not None for s in r.seqs)]
        return list(self.scheduler.running) + holding

    def _fail(self, requests: list[Request], cause: BaseException) -> list[Request]:
        """Ends a failed step's `requests` with a RequestError chained to `cause`, releasing all
        they hold uncached and dropping the step's pending copies. Requests the step already
        finished cleanly keep their results."""
        self.kv.drop_copies()
        return self._fail_each([(request, cause) for request in requests])

    def _fail_each(self, failures: list[tuple[Request, BaseException]]) -> list[Request]:
        """Ends each request with a RequestError chained to its own cause, releasing all it holds
        uncached; the rest of the step stands."""
        for request, cause in failures:
            if request.status is Status.FINISHED:
                continue
            self.scheduler.remove(request)
            request.error = RequestError(request.request_id, cause)
            self._end(request)
        return [request for request, _ in failures]

    def _end(self, request: Request) -> None:
        request.seqs = []
        request.status = Status.FINISHED
        request.finish_time = time.perf_counter()

    def _notify(self, requests: list[Request]) -> None:
        if self.on_update is not None and requests:
            self.on_update(requests)
