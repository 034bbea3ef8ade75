"""Continuous batching with cache-aware admission, preemption, and the step's bookkeeping.

Each step's batch mixes the decodes of running requests with new prefills (chunked when a prompt
exceeds the step's token budget), up to `max_num_seqs` sequences. `schedule()` decides it:
1. Running requests first, oldest first. A request's sequences grow together or not at all;
   when blocks run short the cache is evicted, and when nothing is evictable the newest running
   request is preempted by recomputation: its computed KV goes into the radix tree and its
   blocks are freed, so that resuming it is mostly a cache hit.
2. Then waiting requests, in the waiting queue's order: each matches the radix tree, locks the
   matched path, shares its blocks (a partly matched last block is copied on its first write)
   and gets blocks for its uncached part only. A request whose prompt shares a block or more of
   not-yet-cached tokens with a prompt being prefilled now waits for it, so shared new prefixes
   are computed once and then hit. With a KV store, a request whose prompt continues in the
   store waits (a step or a few, never the step itself) for those blocks to be fetched, and
   they join its match (`radixkv.kvstore.store`). Admission counts exactly what allocation plus eviction can
   deliver (`KVCacheManager.num_available`), and a request's forks (`n`, `beam_width`) count
   against `max_num_seqs` from admission on.
`remove()` takes a request out at any stage (abort, failure), releasing what it holds.
`postprocess()` takes the logits: samples or steps beam search, appends tokens, caches each
prompt's blocks as they are computed, and caches and releases what finished. An error while
sampling or scoring one request's rows is that request's alone: it is handed back as failed and
the rest of the step goes on (`StepOutcome`).

`Scheduler` is one object made of one room per concern: admission in `admission`, the step's
sampling in `step_sampling`, its commit in `step_commit`; this module holds the state they share,
the running requests' growth and preemption (`schedule`), and `remove`. A batch's entries are
`ScheduledSeq`s (`scheduled_seq`).
"""

from __future__ import annotations

import time

import torch

from radixkv.cache.block_pool import OutOfBlocks
from radixkv.cache.kv_cache_manager import KVCacheManager
from radixkv.kvstore.store import KVStore
from radixkv.scheduler.admission import Admission
from radixkv.scheduler.beam_search import BeamSearch
from radixkv.scheduler.request import PLACEHOLDER, Request, Sequence, Status
from radixkv.scheduler.scheduled_seq import ScheduledSeq
from radixkv.scheduler.step_commit import StepCommit, StepOutcome
from radixkv.scheduler.step_sampling import StepSampling
from radixkv.scheduler.waiting_queue import WaitingQueue
from radixkv.structured.masks import MaskFiller


class Scheduler(Admission, StepSampling, StepCommit):
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        eos_token_ids: list[int],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str,
        store: KVStore | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.kv = kv
        self.vocab_size = vocab_size  # the logits' width, for structured output's token masks
        self._masks: MaskFiller | None = None  # made when a structured request first runs
        self.store = store
        self.waits_for_store = False  # the last schedule skipped a request fetching from the store
        self.step_s = 0.0  # the last step's time, from schedule() to postprocess()
        self._scheduled_at = 0.0
        self._store_until: float | None = None  # this schedule's end of waiting on the store
        self.eos = set(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        cache = kv.cache
        self.waiting = WaitingQueue(policy, kv.cached_prefix_len if cache is not None else None)
        self.running: list[Request] = []
        self.beams: dict[str, BeamSearch] = {}
        self.num_preemptions = 0
        self.host_cache_hits = 0  # prompt tokens of first admissions loaded from the host tier
        self.store_cache_hits = 0  # prompt tokens of first admissions fetched from the KV store
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, request: Request) -> None:
        if request.is_beam_search:
            max_new = min(request.params.max_tokens, self.max_model_len - len(request.prompt_ids))
            self.beams[request.request_id] = BeamSearch(request.params, sorted(self.eos), max_new)
        self.waiting.add(request)

    def remove(self, request: Request) -> None:
        """Takes `request` out wherever it is (waiting, running, mid-admission) and releases every
        table it holds, uncached. The caller decides what its sequences' KV was worth."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        self.beams.pop(request.request_id, None)
        self.kv.release_owner(request.request_id)
        for seq in request.seqs:
            seq.table = None
            seq.logprobs = None

    def has_work(self) -> bool:
        return bool(self.running or len(self.waiting))

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seqs for r in self.running)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> list[ScheduledSeq]:
        self.waits_for_store = False
        self._scheduled_at = time.perf_counter()
        self._store_until = None
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        if self.kv.windows and len(self.waiting):  # KV groups: the next to admit keeps its hit's
            head = next(iter(self.waiting))  # window while the running requests grow below
            self.kv.keep_window(head.seqs[0].tokens, head.cache_salt)
        append_slot = self.kv.append_slot
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if len(request.seqs) == 1:  # the usual decode: one token into the sequence's own block
                seq = request.seqs[0]
                start = seq.table.num_tokens
                if len(seq.tokens) == start + 1 and append_slot(seq.table):
                    batch.append(ScheduledSeq(request, seq, start, 1))
                    budget -= 1
                    i += 1
                    continue
            plan = self._plan(request, budget)
            while True:
                try:
                    self.kv.reserve([(seq.table, n) for seq, n in plan])
                    break
                except OutOfBlocks:  # reserve changed nothing
                    victim = self.running[-1]  # never one scheduled already: those are in front
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
            if request.status is not Status.RUNNING:
                continue
            batch += self._scheduled(request, plan)
            budget -= sum(n for _, n in plan)
            i += 1
        # Order the waiting queue only when admission can take something (a step with every slot
        # taken then costs the same however many wait; radixkv bench engine, waiting_*).
        if not preempted and budget > 0 and len(self.waiting) and self.num_running_seqs < self.max_num_seqs:
            budget = self._admit(batch, budget)
        self.waiting.age()
        self._start_masks(batch)
        return batch

    def close(self) -> None:
        """Stops the structured-output mask worker, if a structured request started one."""
        if self._masks is not None:
            self._masks.close()
            self._masks = None

    def _start_masks(self, batch: list[ScheduledSeq]) -> None:
        """Starts filling the token masks of the structured sequences this step samples, to run
        beside the forward pass (`radixkv.structured.masks`)."""
        matchers = [
            item.seq.grammar
            for item in batch
            if item.seq.grammar is not None and item.start_pos + len(item.token_ids) == len(item.seq.tokens)
        ]
        if matchers and self._masks is None:
            self._masks = MaskFiller(self.vocab_size)
        if self._masks is not None:
            self._masks.start(matchers)

    def _plan(self, request: Request, budget: int) -> list[tuple[Sequence, int]]:
        plan = []
        for seq in request.seqs:
            n = min(seq.num_uncomputed, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        return plan

    def _scheduled(self, request: Request, plan: list[tuple[Sequence, int]]) -> list[ScheduledSeq]:
        return [ScheduledSeq(request, seq, seq.table.num_tokens - n, n) for seq, n in plan]

    def _preempt(self, request: Request) -> None:
        for seq in request.seqs:
            self.kv.preempt(seq.table, seq.tokens, seq.num_computed)
            if seq.tokens[-1] == PLACEHOLDER:  # its step's token is dropped: resuming samples again
                seq.tokens.pop()
            seq.table = None
            seq.logprobs = None
        self.running.remove(request)
        request.status = Status.WAITING
        self.waiting.add(request)
        self.num_preemptions += 1

    # -------------------------------------------------------------- postprocess

    def postprocess(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> StepOutcome:
        """Consumes the step's logits (one row per entry of `batch` that needs logits, in
        order); returns the requests that made tokens or finished, and those that failed."""
        return self.commit(self.sample_step(batch, logits))
