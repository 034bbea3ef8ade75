"""Cache-aware admission: which waiting requests join the step, and with how many tokens.

Waiting requests are taken in the waiting queue's order: each matches the radix tree, locks the
matched path, shares its blocks and gets blocks for its uncached part only. A request whose
prompt shares a block or more of not-yet-cached tokens with a prompt being prefilled now waits
for it, so shared new prefixes are computed once and then hit. With a KV store, a request whose
prompt continues in the store waits (a step or a few, never the step itself) for those blocks to
be fetched. Admission counts exactly what allocation plus eviction can deliver
(`KVCacheManager.num_available`), leaving a block of growth for every running sequence.
"""

from __future__ import annotations

import time

from radixkv.cache.radix_tree import common_prefix_len
from radixkv.kvstore.store import StoredRun
from radixkv.scheduler.request import Request, Status
from radixkv.scheduler.scheduled_seq import ScheduledSeq

# How long one schedule's admissions wait on the KV store, all requests together: at least
# STORE_ADMIT_WAIT_S, or STORE_ADMIT_WAIT_SHARE of the last step's time when that is longer. A
# request whose blocks are not fetched by then waits a whole step; waiting delays the step of
# every running request, so it is bounded by a share of the step a skip would cost.
STORE_ADMIT_WAIT_S = 0.01
STORE_ADMIT_WAIT_SHARE = 0.25


class Admission:
    """Mixed into `Scheduler`, which holds `kv`, `store`, `waiting`, `running`, the budgets and
    the prefix-cache counters, and plans (`_plan`) and schedules (`_scheduled`) a request."""

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
                    seq.tokens,
                    request.request_id,
                    request.session_id,
                    stored,
                    request.cache_salt,
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
