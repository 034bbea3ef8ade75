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

`EngineCore` is one object made of one room per concern: requests in, and the aborts, stops
and session closes queued between steps, in `intake`; what a caller reads back in `results`;
this module builds the core and holds the step, its failures, the control methods and metrics.
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
from radixkv.config import EngineConfig
from radixkv.dashboard.cache_view import capture_view
from radixkv.engine.input_processor import InputProcessor
from radixkv.engine.intake import RequestIntake
from radixkv.engine.metrics import EngineMetrics
from radixkv.engine.overlap import OverlapStepper
from radixkv.engine.results import RequestResults
from radixkv.errors import RequestError
from radixkv.kvstore import KeySpace, KVStore, open_backend
from radixkv.metrics import prometheus_text
from radixkv.model.loader import load_model
from radixkv.model.memory_profile import kv_cache_budget
from radixkv.model.parallel_runner import ParallelRunner
from radixkv.model.runner import ModelRunner, kv_block_bytes
from radixkv.model.stored_kv import model_fingerprint
from radixkv.model.tokenizer_threads import PerThreadTokenizer
from radixkv.scheduler.request import Request, Status
from radixkv.scheduler.scheduler import ScheduledSeq, Scheduler
from radixkv.structured.grammar import GrammarCompiler

STORE_QUEUE_BYTES = 256 * 2**20


class EngineCore(RequestIntake, RequestResults):
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
            m,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
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
                m,
                self.pool.num_blocks,
                config.block_size,
                num_host,
                cuda_graph_max_seqs=graph_seqs,
                groups=self.groups,
                kv_cache_dtype=config.kv_cache_dtype,
            )
            self.runner.store = self.store
        self.inputs = InputProcessor(
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            config.max_num_seqs,
            self.pool.num_blocks,
            config.block_size,
            self.runner.device,
            windows=self.kv.windows,
            max_num_batched_tokens=config.max_num_batched_tokens,
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

    # ---------------------------------------------------------------- metrics

    def metrics(self) -> dict:
        """Counters, gauges and latency histograms (`radixkv.engine.metrics`)."""
        return self.stats.snapshot(self.pool, self.kv, self.scheduler, self.store, len(self._inbox))

    def metrics_text(self) -> str:
        """The metrics in Prometheus' text exposition format."""
        return prometheus_text(self.metrics())

    def dashboard(self, namespaces: list[int] | None = None) -> dict:
        """What `/dashboard` shows, captured between steps; the caller finishes it
        (`radixkv.dashboard.cache_view`: the step waits only for the capture)."""
        with self._lock:
            return capture_view(self, namespaces)

    def check_invariants(self) -> None:
        """Every block, reference and lock accounted for, and every live table held by a running
        sequence (see `KVCacheManager.check_invariants`). Waits for the step in flight."""
        with self._lock:
            self.kv.check_invariants(self.live_tables())

    def live_tables(self) -> list[BlockTable]:
        """The block tables of the running sequences."""
        return [s.table for r in self.scheduler.running for s in r.seqs if s.table is not None]

    # ---------------------------------------------------------------- internals

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
