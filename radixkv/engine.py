"""The engine users call: requests in, tokens out, every shared prefix computed once.

One step reads top to bottom: the scheduler picks the batch (admitting, growing, preempting),
the pending block copies run, the model runs one forward pass over the paged KV cache, and the
scheduler turns the logits into tokens, finishing and caching what is done.

Submission is thread-safe: any thread may add requests at any time, and the engine steps in
whichever threads are waiting for results (`generate`, `stream`, `beam_search`, `run_until`), one
step at a time under a lock. Requests from all threads share every step's batch.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from radixkv.cache.block_pool import BlockPool, num_blocks_for_budget
from radixkv.cache.eviction import make_policy
from radixkv.cache.kv_cache_manager import BlockTable, KVCacheManager
from radixkv.cache.radix_cache import RadixCache
from radixkv.chat_session import ChatSession
from radixkv.config import EngineConfig
from radixkv.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Histogram, prometheus_text
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner, SequenceChunk, kv_block_bytes
from radixkv.model.sampler import make_generator
from radixkv.outputs import Beam, RequestOutput, Sample, StreamDelta
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.scheduler.request import Request, Sequence, Status
from radixkv.scheduler.scheduler import ScheduledSeq, Scheduler

Prompt = str | list[int]


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible run to run
        self.model = load_model(config.model, dtype=config.dtype, device=config.device, seed=config.seed)
        self.tokenizer = self.model.tokenizer
        self.max_model_len = self.model.max_model_len
        if config.max_model_len is not None:
            if config.max_model_len > self.max_model_len:
                raise ValueError(
                    f"max_model_len {config.max_model_len} exceeds the model's {self.max_model_len}"
                )
            self.max_model_len = config.max_model_len
        m = self.model
        per_block = kv_block_bytes(m.num_layers, config.block_size, m.num_kv_heads, m.head_dim, m.dtype)
        budget = config.kv_cache_memory or default_kv_cache_memory(m.device)
        self.pool = BlockPool(num_blocks_for_budget(budget, per_block), config.block_size)
        cache = RadixCache(self.pool, make_policy(config.eviction)) if config.enable_prefix_cache else None
        self.kv = KVCacheManager(self.pool, cache)
        self.runner = ModelRunner(m, self.pool.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.kv,
            eos_token_ids=m.eos_token_ids,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling,
        )
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.step_hooks: list[Callable[[Engine], None]] = []  # called after every step
        self.num_steps = 0  # steps that ran a batch

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> Engine:
        """An engine for a local Hugging Face folder; keyword arguments are `EngineConfig` fields."""
        return cls(EngineConfig(model=str(path), **kwargs))

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | BeamSearchParams | None = None,
        session_id: str | None = None,
    ) -> str:
        """Validates and queues a request; returns its id. Bad input raises ValueError naming the
        field, before any work and without touching other requests. `session_id` makes it a
        turn of that chat session (see `close_session`)."""
        return self._submit([self._new_request(prompt, params, session_id)])[0]

    def close_session(self, session_id: str) -> None:
        """The chat session has no more turns: under the `session` policy its cached blocks
        lose their rank over one-off requests' (a later turn with the same id revives it)."""
        with self._lock:
            self.kv.close_session(session_id)

    def step(self) -> list[Request]:
        """Runs one engine step; returns the requests that made progress (new tokens or done)."""
        with self._lock:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            self.num_steps += 1
            self.kv.run_transfers(self.runner)
            logits = self.runner.forward([self._chunk(item) for item in batch])
            touched = self.scheduler.postprocess(batch, logits)
            self._observe(touched)
            for hook in self.step_hooks:
                hook(self)
            return touched

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def run_until(self, done: Callable[[], bool]) -> None:
        """Steps the engine until `done()`. Never spins: when steps stop running batches before
        `done()` (a request lost, or one that can never be scheduled), raises RuntimeError."""
        idle = 0
        while not done():
            before = self.num_steps
            self.step()
            idle = idle + 1 if self.num_steps == before else 0
            if idle > 2 and not done():  # a step after a preemption may rightly run nothing
                raise RuntimeError("the engine stopped making progress before the awaited requests finished")

    def output(self, request_id: str) -> RequestOutput:
        """The output of a finished request (and forgets the request)."""
        with self._lock:
            request = self._requests.pop(request_id)
        seqs = sorted(request.finished_seqs, key=lambda s: s.index)
        samples = [Sample(s.output_ids, self.decode(s.output_ids), s.finish_reason) for s in seqs]
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_ids,
            samples=samples,
            num_cached_tokens=request.num_cached_tokens or 0,
            ttft_s=request.first_token_time - request.arrival_time,
            e2e_s=request.finish_time - request.arrival_time,
        )

    def is_finished(self, request_id: str) -> bool:
        return self._requests[request_id].status is Status.FINISHED

    # ---------------------------------------------------------------- the API

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | None = None,
        session_id: str | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts (text or token-id lists) to completion, batched together."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        # All valid, or none queued.
        ids = self._submit([self._new_request(p, params, session_id) for p in prompts])
        self.run_until(lambda: all(self.is_finished(i) for i in ids))
        return [self.output(i) for i in ids]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, session_id: str | None = None
    ) -> Iterator[StreamDelta]:
        """Yields each generated token as soon as it is made, with its piece of text."""
        if params is not None and params.n != 1:
            raise ValueError(f"stream takes n == 1, got n={params.n}")
        request_id = self.add_request(prompt, params, session_id)
        request = self._requests[request_id]
        seq = request.seqs[0]  # with n == 1 this sequence lives from submission to the end
        sent, seen, text = 0, 0, ""
        while True:
            self.run_until(lambda seen=seen: request.status is Status.FINISHED or len(seq.output_ids) > seen)
            tokens = seq.output_ids
            seen = len(tokens)
            finished = request.status is Status.FINISHED
            for i in range(sent, seen):
                full = self.decode(tokens[: i + 1])
                last = i == seen - 1
                partial = full.endswith("\ufffd") and not (last and finished)  # a character's first bytes
                if partial and last:
                    break  # wait for the rest of the character
                piece = "" if partial else full[len(text) :]
                yield StreamDelta(tokens[i], piece, seq.finish_reason if last and finished else None)
                sent, text = i + 1, text if partial else full
            if finished:
                self.output(request_id)
                return

    def beam_search(self, prompt: Prompt, params: BeamSearchParams | None = None) -> list[Beam]:
        """Beam search inside the engine: beams share their blocks and copy only a partly filled
        last block when they write. Returns the `beam_width` best hypotheses, best first."""
        request_id = self.add_request(prompt, params or BeamSearchParams())
        self.run_until(lambda: self.is_finished(request_id))
        return self.beam_output(request_id)

    def beam_output(self, request_id: str) -> list[Beam]:
        """The beams of a finished beam-search request, best first (and forgets the request)."""
        with self._lock:
            request = self._requests.pop(request_id)
        return [Beam(s.output_ids, self.decode(s.output_ids), s.score) for s in request.finished_seqs]

    def chat(self, system: str | list[int] | None = None) -> ChatSession:
        """A chat session whose every turn reuses the KV of the conversation before it."""
        return ChatSession(self, system)

    def metrics(self) -> dict:
        cache = self.kv.cache
        return {
            "kv_cache_usage": 1.0 - self.pool.num_free / self.pool.num_blocks,
            "num_blocks": self.pool.num_blocks,
            "num_free_blocks": self.pool.num_free,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_evicted_blocks": cache.num_evicted if cache else 0,
            "num_cow_copies": self.kv.num_cow_copies,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "time_to_first_token_seconds": self.ttft.as_dict(),
            "inter_token_latency_seconds": self.itl.as_dict(),
            "e2e_request_latency_seconds": self.e2e.as_dict(),
        }

    def metrics_text(self) -> str:
        """The metrics in Prometheus' text exposition format."""
        return prometheus_text(self.metrics())

    def check_invariants(self) -> None:
        """Every block, reference and lock accounted for (see `KVCacheManager.check_invariants`)."""
        with self._lock:
            self.kv.check_invariants(self.live_tables())

    def live_tables(self) -> list[BlockTable]:
        """The block tables of the running sequences."""
        return [s.table for r in self.scheduler.running for s in r.seqs if s.table is not None]

    # ---------------------------------------------------------------- internals

    def _new_request(
        self, prompt: Prompt, params: SamplingParams | BeamSearchParams | None, session_id: str | None = None
    ) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams | BeamSearchParams):
            raise ValueError(
                f"params must be SamplingParams or BeamSearchParams, got {type(params).__name__}"
            )
        params.validate()
        ids = self._prompt_ids(prompt)
        self._check_fits(ids, params)
        seq = Sequence(list(ids), len(ids))
        if isinstance(params, SamplingParams) and params.seed is not None:
            seq.generator = make_generator(params.seed, self.runner.device)
        return Request(str(next(self._ids)), list(ids), params, [seq], session_id=session_id)

    def _submit(self, requests: list[Request]) -> list[str]:
        with self._lock:
            for request in requests:
                self._requests[request.request_id] = request
                self.scheduler.add(request)
        return [r.request_id for r in requests]

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text, but this model has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list):
            ids = prompt
        else:
            raise ValueError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad!r}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len {self.max_model_len} leaves no room to generate"
            )
        return ids

    def _check_fits(self, ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        """A request that could not fit in the pool even alone would wait forever: refuse it."""
        width = params.beam_width if isinstance(params, BeamSearchParams) else params.n
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        prompt_blocks = self.kv.blocks_for(len(ids))
        need = prompt_blocks + width * (self.kv.blocks_for(total) - prompt_blocks + 1)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks (prompt {len(ids)} tokens, max_tokens "
                f"{params.max_tokens}, {width} sequences) but the pool has {self.pool.num_blocks}; "
                "raise kv_cache_memory or shorten the request"
            )

    def _chunk(self, item: ScheduledSeq) -> SequenceChunk:
        seq = item.seq
        return SequenceChunk(
            token_ids=seq.tokens[item.start : item.start + item.num_tokens],
            start_pos=item.start,
            block_table=seq.table.blocks,
            logits="last" if item.needs_logits else "none",
        )

    def _observe(self, touched: list[Request]) -> None:
        for request in touched:
            if request.status is Status.FINISHED:
                self.ttft.observe(request.first_token_time - request.arrival_time)
                self.e2e.observe(request.finish_time - request.arrival_time)
                for gap in request.inter_token_s:
                    self.itl.observe(gap)

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens left out ("" for a model without a tokenizer)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def default_kv_cache_memory(device: torch.device) -> int:
    """Bytes for the KV cache when none are given: 80% of the GPU's free memory once the model
    is loaded (the rest for activations), or on a CPU a fifth of the available RAM, at most 1 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(available // 5, 1 << 30)
