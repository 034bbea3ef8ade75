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
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixkv.cache.block_pool import OutOfBlocks
from radixkv.cache.kv_cache_manager import KVCacheManager
from radixkv.cache.radix_tree import common_prefix_len
from radixkv.kvstore.store import KVStore, StoredRun
from radixkv.outputs import TokenLogprob
from radixkv.sampling.logits_processors import TokenMask
from radixkv.sampling.sampler import compute_logprobs, make_generator, sample, token_logprobs
from radixkv.sampling_params import sample_seed
from radixkv.scheduler.beam_search import BeamSearch
from radixkv.scheduler.chunk import SequenceChunk
from radixkv.scheduler.request import PLACEHOLDER, Request, Sequence, Status
from radixkv.scheduler.waiting_queue import WaitingQueue
from radixkv.structured.masks import MaskFiller


class StepOutcome(NamedTuple):
    """What `postprocess` made of a step: the requests that made tokens or finished, and those
    whose own sampling or beam scoring raised, each with its error (still holding their blocks:
    the engine removes them)."""

    touched: list[Request]
    failed: list[tuple[Request, Exception]]


class SampledStep(NamedTuple):
    """A step's tokens before they are appended (`Scheduler.sample_step`, then `commit`):
    sampled sequence j is `requests[j]`'s `seqs[j]`, with `tokens[j]` (None when its request's
    sampling raised, in `failed`) and logprob `records[j]`; `beam_rows` are the beam groups
    whose rows were scored; `batch` the step's entries."""

    batch: list[ScheduledSeq]
    requests: list[Request]
    seqs: list[Sequence]
    tokens: list[int | None]
    records: list[TokenLogprob | None]
    beam_rows: dict[str, Request]
    failed: dict[str, tuple[Request, Exception]]


# How long one schedule's admissions wait on the KV store, all requests together: at least
# STORE_ADMIT_WAIT_S, or STORE_ADMIT_WAIT_SHARE of the last step's time when that is longer. A
# request whose blocks are not fetched by then waits a whole step; waiting delays the step of
# every running request, so it is bounded by a share of the step a skip would cost.
STORE_ADMIT_WAIT_S = 0.01
STORE_ADMIT_WAIT_SHARE = 0.25


@dataclass(slots=True, init=False)
class ScheduledSeq(SequenceChunk):
    """The chunk of `seq` (a sequence of `request`) computed this step: `num_tokens` tokens from
    position `start`, with logits (`"last"`) when they reach the sequence's last token (a decode,
    or a prompt's last chunk). The batch goes to the model runner as it is: building a second
    object per sequence for the runner took 80 us of a 256-sequence decode step."""

    request: Request
    seq: Sequence

    def __init__(self, request: Request, seq: Sequence, start: int, num_tokens: int) -> None:
        end = start + num_tokens
        self.request, self.seq = request, seq
        self.token_ids, self.start_pos, self.block_table = seq.tokens[start:end], start, seq.table.blocks
        self.group_tables = seq.table.extra
        self.logits = "last" if end == len(seq.tokens) else "none"
        if request.prompt_logprobs is not None and start < seq.num_prompt_tokens:
            self.logits = "all"  # the prompt's logprobs: one row per token, the last maybe sampled


class Scheduler:
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

    def _admit(self, batch: list[ScheduledSeq], budget: int) -> int:
        for request in self.waiting.ordered():
            if budget <= 0 or self.num_running_seqs + request.num_seqs > self.max_num_seqs:
                break
            if self._waits_for_shared_prefill(request):
                continue
            stored = self._stored_run(request)
            if stored is None:
                self.waits_for_store = True
                continue
            for seq in request.seqs:
                assert seq.table is None, f"request {request.request_id} is waiting but holds a table"
                seq.table = self.kv.admit(
                    seq.tokens, request.request_id, request.session_id, stored, request.cache_salt,
                    request.max_cached_prompt,
                )
                stored = None  # the first sequence's blocks are in the tree: the others match them
            cached = request.seqs[0].table.num_tokens
            plan = self._plan(request, budget)
            need = self.kv.blocks_needed([(s.table, n) for s, n in plan])
            # Leave a block of growth for every running sequence, or the next step preempts.
            if need > self.kv.num_available - self.num_running_seqs:
                for seq in request.seqs:
                    self.kv.release(seq.table)
                    seq.table = None
                break
            self.kv.reserve([(seq.table, n) for seq, n in plan])  # cannot run short: the count is exact
            if request.num_cached_tokens is None:
                request.num_cached_tokens = cached
                self.prefix_cache_queries += len(request.prompt_ids)
                self.prefix_cache_hits += request.num_cached_tokens
                self.host_cache_hits += request.seqs[0].table.num_loaded_tokens
                self.store_cache_hits += request.seqs[0].table.num_stored_tokens
            self.waiting.remove(request)
            self.running.append(request)
            request.status = Status.RUNNING
            self.kv.swap_in(request.request_id)
            batch += self._scheduled(request, plan)
            budget -= sum(n for _, n in plan)
        return budget

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

    def _stored_run(self, request: Request) -> StoredRun | None:
        """The store's blocks that continue the tree's match of a first admission's prompt (an
        empty run without a store), or None while they are being looked up or fetched."""
        lookup = request.store_lookup
        if self.store is None or lookup is None or request.num_cached_tokens is not None:
            return StoredRun(0)
        start = self.kv.cache.cached_prefix_len(lookup.tokens) // self.kv.block_size
        if start == len(lookup.tokens) // self.kv.block_size:  # the memory tiers hold every block
            return StoredRun(start)
        now = time.perf_counter()
        if self._store_until is None:
            self._store_until = now + max(STORE_ADMIT_WAIT_S, STORE_ADMIT_WAIT_SHARE * self.step_s)
        return self.store.poll(lookup, start, max(0.0, self._store_until - now))

    def _waits_for_shared_prefill(self, request: Request) -> bool:
        """Whether a prompt being prefilled now shares a block or more of tokens with this one
        that the cache does not hold yet: then this request waits and hits them next."""
        if self.kv.cache is None:
            return False
        prompt = request.prompt_ids
        cached = None
        for other in self.running:
            if other.prompt_done or other.cache_salt != request.cache_salt:
                continue
            shared = common_prefix_len(prompt, other.prompt_ids)
            if shared < self.kv.block_size:
                continue
            if cached is None:
                cached = self.kv.cached_prefix_len(prompt, request.cache_salt)
            if shared - cached >= self.kv.block_size:
                return True
        return False

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

    def sample_step(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> SampledStep:
        """The step's tokens, not yet appended (`commit` does). An entry whose sequence has
        ended since it was scheduled (finished a step early, aborted, preempted, failed: its
        table is gone) has its rows skipped: with overlap its extra token is discarded.

        One pass over the batch sorts its rows into sampled ones and beam ones, then one `sample`
        call (one argmax for a greedy batch) and one `.tolist()` serve every sampled row. When
        the rows are the logits in order (no beams, no forks), they are not gathered: indexing
        256 rows by a list cost 110 us."""
        now = time.perf_counter()
        self.step_s = now - self._scheduled_at
        requests: list[Request] = []  # sampled: sequence j of `seqs` is request j's, from row `rows[j]`
        seqs: list[Sequence] = []
        rows: list[int] = []
        grammars: list = []  # per sampled row, the matcher whose mask it takes (a fork: its parent's)
        beam_rows: dict[str, Request] = {}
        forked = False  # the sampled rows are not the logits in order
        row = 0
        for item in batch:
            seq, request = item.seq, item.request
            if seq.table is None:
                if item.logits != "none":
                    row += len(item.token_ids) if item.logits == "all" else 1
                    forked = True  # the sampled rows skip these
                continue
            if item.logits == "all":
                num_rows = len(item.token_ids)
                _record_prompt_logprobs(request, item.start_pos, logits[row : row + num_rows])
                forked = True
                row += num_rows - 1  # the last row: sampled if the chunk ends the prompt
                if item.start_pos + num_rows < len(seq.tokens):
                    row += 1
                    continue
            elif item.logits != "last":
                continue
            if request.is_beam_search:
                seq.logprobs = compute_logprobs(logits[row])
                beam_rows[request.request_id] = request
            elif request.params.n > 1 and not request.prompt_done:
                request.seqs += [self._fork(seq, k) for k in range(1, request.params.n)]
                forked = True
                for s in request.seqs:
                    requests.append(request)
                    seqs.append(s)
                    rows.append(row)
                    grammars.append(seq.grammar)
            else:
                requests.append(request)
                seqs.append(seq)
                rows.append(row)
                grammars.append(seq.grammar)
            row += 1
        failed: dict[str, tuple[Request, Exception]] = {}
        tokens: list[int | None] = []
        records: list[TokenLogprob | None] = []
        if seqs:
            chosen = logits if not forked and not beam_rows else logits[rows]
            tokens, records = self._sample(chosen, requests, seqs, failed, self._token_mask(grammars))
        return SampledStep(batch, requests, seqs, tokens, records, beam_rows, failed)

    def commit(self, sampled: SampledStep) -> StepOutcome:
        """Appends a sampled step's tokens, steps its beam groups, finishes and caches what is
        done; returns the requests that made tokens or finished, and those that failed. Prompts
        cache their computed blocks first, as they go."""
        now = time.perf_counter()
        touched: dict[str, Request] = {}
        batch, requests, seqs, tokens, records, beam_rows, failed = sampled
        for item in batch:
            seq = item.seq
            if seq.table is not None and seq.num_computed <= seq.num_prompt_tokens:
                self.kv.cache_running(seq.table, seq.tokens, seq.num_computed)
        if seqs:
            append = self._append
            for request, seq, token, record in zip(requests, seqs, tokens, records, strict=True):
                if token is None or request.request_id in failed:  # its request failed
                    continue
                # A matcher in error (its grammar matches nothing more) reads as stopped: it fails
                # the request, never finishes it as "stop" with text the grammar did not complete.
                grammar = seq.grammar
                if grammar is not None and (not grammar.consume_token(token) or grammar.is_error()):
                    error = ValueError(f"structured output rejected token {token}: {grammar.get_error()}")
                    failed[request.request_id] = (request, error)
                    continue
                if record is not None:
                    seq.token_logprobs.append(record)
                append(request, seq, token)
                touched[request.request_id] = request
        for request in beam_rows.values():
            if all(seq.logprobs is not None for seq in request.seqs):
                try:
                    self._beam_step(request)
                except Exception as error:
                    failed[request.request_id] = (request, error)
                    continue
                touched[request.request_id] = request
        for request in touched.values():  # each made tokens this step: one stamp per request
            if request.first_token_time is None:
                request.first_token_time = now
            else:
                request.inter_token_s.append(now - request.last_token_time)
            request.last_token_time = now
            if not request.seqs:
                self.running.remove(request)
                request.status = Status.FINISHED
                request.finish_time = now
        return StepOutcome(list(touched.values()), list(failed.values()))

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        seqs: list[Sequence],
        failed: dict[str, tuple[Request, Exception]],
        mask: TokenMask | None = None,
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Row i's token and logprob record, batched. If the batch raises, each request's rows are
        sampled alone and a request whose own rows raise goes into `failed` (its tokens None), so
        that one request's parameters can never fail its neighbours. (A seeded neighbour may then
        have drawn twice this step: only in a step that hit such an error.)"""
        params = [request.params for request in requests]
        generators = [seq.generator for seq in seqs]
        try:
            tokens = sample(logits, params, generators, seqs, self.eos, mask)
            return tokens.tolist(), token_logprobs(logits, tokens, [p.logprobs for p in params])
        except Exception:  # find the request at fault below
            pass
        by_request: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            by_request.setdefault(request.request_id, []).append(i)
        out_tokens: list[int | None] = [None] * len(requests)
        out_records: list[TokenLogprob | None] = [None] * len(requests)
        for request_id, rows in by_request.items():
            try:
                own = logits[rows]
                own_params, own_seqs = [params[i] for i in rows], [seqs[i] for i in rows]
                own_mask = _own_mask(mask, rows)
                tokens = sample(own, own_params, [generators[i] for i in rows], own_seqs, self.eos, own_mask)
                records = token_logprobs(own, tokens, [params[i].logprobs for i in rows])
            except Exception as error:
                failed[request_id] = (requests[rows[0]], error)
                continue
            for i, token, record in zip(rows, tokens.tolist(), records, strict=True):
                out_tokens[i], out_records[i] = token, record
        return out_tokens, out_records

    def _token_mask(self, grammars: list) -> TokenMask | None:
        """The structured sampled rows' token mask, or None when no row is structured: the rows
        the step's `_start_masks` filled, in row order."""
        structured = [j for j, g in enumerate(grammars) if g is not None]
        if not structured:
            return None
        return TokenMask(structured, self._masks.rows([grammars[j] for j in structured]))

    def _fork(self, seq: Sequence, k: int) -> Sequence:
        """Sample k of a request with n > 1: shares the prompt's blocks, and draws from its own
        generator (seeded from the request's seed and k) when the request is seeded."""
        generator = None
        if seq.generator is not None:
            generator = make_generator(sample_seed(seq.generator.initial_seed(), k), seq.generator.device)
        return seq.fork(self.kv.fork(seq.table), k, generator)

    def _append(self, request: Request, seq: Sequence, token: int) -> None:
        tokens = seq.tokens
        tokens.append(token)
        params = request.params
        stop_string = False
        if params.stop:  # only a stop string needs the text now; readers detokenize the rest
            seq.detok.push(tokens)
            stop_string = seq.detok.stopped
        grammar_done = seq.grammar is not None and seq.grammar.is_stopped()
        if (
            token in params.stop_token_ids
            or (token in self.eos and not params.ignore_eos)
            or stop_string
            or grammar_done
            or seq.stop_requested
        ):
            seq.finish_reason = "stop"
        elif len(tokens) - seq.num_prompt_tokens >= params.max_tokens or len(tokens) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.kv.cache_finished(seq.table, tokens, seq.num_computed)
            seq.table = None
            request.seqs.remove(seq)
            request.finish_seq(seq, seq.finish_reason)

    def _beam_step(self, request: Request) -> None:
        search = self.beams[request.request_id]
        rows = torch.stack([seq.logprobs for seq in request.seqs])
        for seq in request.seqs:
            seq.logprobs = None
        continuations = search.step(rows, [seq.output_ids for seq in request.seqs])
        parents = request.seqs
        chosen = Counter(0 if len(parents) == 1 else c.parent for c in continuations)
        for i, seq in enumerate(parents):
            if not chosen[i]:  # pruned: its blocks go back before any survivor copies a block
                self.kv.release(seq.table)
                seq.table = None
        before = [list(seq.tokens) for seq in parents]
        beams = []
        reused: set[int] = set()
        for c in continuations:
            p = 0 if len(parents) == 1 else c.parent
            if p in reused:  # a second continuation of one beam: share its blocks
                table = self.kv.fork(parents[p].table)
                beams.append(Sequence(before[p] + [c.token], len(request.prompt_ids), table))
            else:
                reused.add(p)
                parents[p].tokens.append(c.token)
                beams.append(parents[p])
        request.seqs = beams
        if search.done:
            request.finished_seqs = [
                Sequence(
                    request.prompt_ids + tokens,
                    len(request.prompt_ids),
                    score=score,
                    finish_reason="stop" if tokens and tokens[-1] in search.eos else "length",
                )
                for tokens, score in search.results()
            ]
            del self.beams[request.request_id]


def _own_mask(mask: TokenMask | None, rows: list[int]) -> TokenMask | None:
    """The part of `mask` for the sampled rows `rows`, renumbered as they are sampled alone."""
    if mask is None:
        return None
    where = {row: j for j, row in enumerate(mask.rows)}
    own = [(k, where[row]) for k, row in enumerate(rows) if row in where]
    if not own:
        return None
    return TokenMask([k for k, _ in own], mask.bitmask[[j for _, j in own]])


def _record_prompt_logprobs(request: Request, start: int, rows: torch.Tensor) -> None:
    """Appends the records of the prompt tokens that `rows` (the logits of positions `start`
    on) predict and that are not recorded yet: row r gives prompt token `start + r + 1`. A
    chunk recomputed after a preemption records nothing twice."""
    records = request.prompt_logprobs
    prompt = request.prompt_ids
    first = max(start, len(records) - 1)
    end = min(start + rows.shape[0], len(prompt) - 1)
    if first >= end:
        return
    targets = torch.tensor(prompt[first + 1 : end + 1], device=rows.device)
    k = request.params.prompt_logprobs
    rows = rows[first - start : end - start]
    new = token_logprobs(rows, targets, [k] * (end - first))
    chosen = rows.gather(1, targets.unsqueeze(1))
    for record, rank in zip(new, ((rows > chosen).sum(dim=1) + 1).tolist(), strict=True):
        record.rank = rank
    records += new
