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
   are computed once and then hit. Admission counts exactly what allocation plus eviction can
   deliver (`KVCacheManager.num_available`), and a request's forks (`n`, `beam_width`) count
   against `max_num_seqs` from admission on.
`remove()` takes a request out at any stage (abort, failure), releasing what it holds.
`postprocess()` takes the logits: samples or steps beam search, appends tokens, caches each
prompt's blocks as they are computed, and caches and releases what finished.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from radixkv.scheduler.beam_search import BeamSearch
from radixkv.scheduler.request import Request, Sequence, Status
from radixkv.scheduler.waiting_queue import WaitingQueue

from radixkv.cache.block_pool import OutOfBlocks
from radixkv.cache.kv_cache_manager import KVCacheManager
from radixkv.cache.radix_cache import common_prefix_len
from radixkv.model.runner import SequenceChunk
from radixkv.model.sampler import compute_logprobs, make_generator, sample, token_logprobs


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
    ) -> None:
        self.kv = kv
        self.eos = set(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        cache = kv.cache
        self.waiting = WaitingQueue(policy, cache.cached_prefix_len if cache is not None else None)
        self.running: list[Request] = []
        self.beams: dict[str, BeamSearch] = {}
        self.num_preemptions = 0
        self.host_cache_hits = 0  # prompt tokens of first admissions loaded from the host tier
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
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
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
        return batch

    def _admit(self, batch: list[ScheduledSeq], budget: int) -> int:
        for request in self.waiting.ordered():
            if budget <= 0 or self.num_running_seqs + request.num_seqs > self.max_num_seqs:
                break
            if self._waits_for_shared_prefill(request):
                continue
            for seq in request.seqs:
                assert seq.table is None, f"request {request.request_id} is waiting but holds a table"
                seq.table = self.kv.admit(
                    seq.tokens, request.request_id, request.session_id, request.max_cached_prompt
                )
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

    def _waits_for_shared_prefill(self, request: Request) -> bool:
        """Whether a prompt being prefilled now shares a block or more of tokens with this one
        that the cache does not hold yet: then this request waits and hits them next."""
        if self.kv.cache is None:
            return False
        prompt = request.prompt_ids
        cached = None
        for other in self.running:
            if other.prompt_done:
                continue
            shared = common_prefix_len(prompt, other.prompt_ids)
            if shared < self.kv.block_size:
                continue
            if cached is None:
                cached = self.kv.cache.cached_prefix_len(prompt)
            if shared - cached >= self.kv.block_size:
                return True
        return False

    def _preempt(self, request: Request) -> None:
        for seq in request.seqs:
            self.kv.preempt(seq.table, seq.tokens)
            seq.table = None
            seq.logprobs = None
        self.running.remove(request)
        request.status = Status.WAITING
        self.waiting.add(request)
        self.num_preemptions += 1

    # -------------------------------------------------------------- postprocess

    def postprocess(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> list[Request]:
        """Consumes the step's logits (one row per entry of `batch` that needs logits, in
        order); returns the requests that made tokens or finished.

        One pass over the batch sorts its rows into sampled ones and beam ones, then one `sample`
        call (one argmax for a greedy batch) and one `.tolist()` serve every sampled row. When
        the rows are the logits in order (no beams, no forks), they are not gathered: indexing
        256 rows by a list cost 110 us."""
        now = time.perf_counter()
        requests: list[Request] = []  # sampled: sequence j of `seqs` is request j's, from row `rows[j]`
        seqs: list[Sequence] = []
        rows: list[int] = []
        beam_rows: dict[str, Request] = {}
        forked = False  # the sampled rows are not the logits in order
        row = 0
        for item in batch:
            seq, request = item.seq, item.request
            if seq.table.num_tokens <= seq.num_prompt_tokens:
                self.kv.cache_running(seq.table, seq.tokens)
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
            else:
                requests.append(request)
                seqs.append(seq)
                rows.append(row)
            row += 1
        touched: dict[str, Request] = {}
        if seqs:
            chosen = logits if not forked and not beam_rows else logits[rows]
            params = [request.params for request in requests]
            tokens = sample(chosen, params, [seq.generator for seq in seqs], seqs, self.eos)
            records = token_logprobs(chosen, tokens, [p.logprobs for p in params])
            append = self._append
            for request, seq, token, record in zip(requests, seqs, tokens.tolist(), records, strict=True):
                if record is not None:
                    seq.token_logprobs.append(record)
                append(request, seq, token)
                touched[request.request_id] = request
        for request in beam_rows.values():
            if all(seq.logprobs is not None for seq in request.seqs):
                self._beam_step(request)
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
        return list(touched.values())

    def _fork(self, seq: Sequence, k: int) -> Sequence:
        """Sample k of a request with n > 1: shares the prompt's blocks, and draws from its own
        generator (seeded from the request's seed and k) when the request is seeded."""
        generator = None
        if seq.generator is not None:
            generator = make_generator(seq.generator.initial_seed() + k, seq.generator.device)
        return seq.fork(self.kv.fork(seq.table), k, generator)

    def _append(self, request: Request, seq: Sequence, token: int) -> None:
        tokens = seq.tokens
        tokens.append(token)
        params = request.params
        stop_string = False
        if params.stop:  # only a stop string needs the text now; readers detokenize the rest
            seq.detok.push(tokens)
            stop_string = seq.detok.stopped
        if token in params.stop_token_ids or (token in self.eos and not params.ignore_eos) or stop_string:
            seq.finish_reason = "stop"
        elif len(tokens) - seq.num_prompt_tokens >= params.max_tokens or len(tokens) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.kv.cache_finished(seq.table, tokens)
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
