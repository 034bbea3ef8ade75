"""What an engine core reports about itself: `EngineMetrics`.

Counters and gauges are read where they are kept (the block pool, the cache and its host tier,
the scheduler, the KV store) at the time of the call, so there is no second set of counts to
drift from the first. The three latency histograms are the only state of their own: a request is
observed once, at the end of the step that finished it, from its own time stamps (arrival, first
token, each token after, finish). `radixkv.metrics` names and formats them.
"""

from __future__ import annotations

from typing import Any

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.kv_cache_manager import KVCacheManager
from radixkv.kvstore import KVStore
from radixkv.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Histogram
from radixkv.scheduler.request import Request, Status
from radixkv.scheduler.scheduler import Scheduler


class EngineMetrics:
    """The latency histograms of one engine core, and its metrics dict (`snapshot`)."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def observe(self, touched: list[Request]) -> None:
        """A step's requests: those it finished, having made a token, go into the histograms."""
        for request in touched:
            if request.status is Status.FINISHED and request.first_token_time is not None:
                self.ttft.observe(request.first_token_time - request.arrival_time)
                self.e2e.observe(request.finish_time - request.arrival_time)
                for gap in request.inter_token_s:
                    self.itl.observe(gap)

    def snapshot(
        self, pool: BlockPool, kv: KVCacheManager, scheduler: Scheduler, store: KVStore | None, queued: int
    ) -> dict[str, Any]:
        """The metrics dict of `EngineCore.metrics` (names in `radixkv.metrics`); `queued` counts
        the submissions no step has drained yet, which wait with the scheduler's waiting ones."""
        cache = kv.cache
        host = cache.host if cache is not None else None
        return {
            "kv_cache_usage": 1.0 - pool.num_free / pool.num_blocks,
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free,
            "prefix_cache_queries": scheduler.prefix_cache_queries,
            "prefix_cache_hits": scheduler.prefix_cache_hits,
            "num_preemptions": scheduler.num_preemptions,
            "num_evicted_blocks": cache.num_evicted if cache else 0,
            "num_cow_copies": kv.num_cow_copies,
            "num_host_blocks": host.pool.num_blocks if host else 0,
            "num_free_host_blocks": host.pool.num_free if host else 0,
            "host_cache_hits": scheduler.host_cache_hits,
            "num_offloaded_blocks": host.num_offloaded if host else 0,
            "num_loaded_blocks": host.num_loaded if host else 0,
            "num_swapped_out_blocks": kv.num_swapped_out_blocks,
            "num_swapped_in_blocks": kv.num_swapped_in_blocks,
            "store_cache_hits": scheduler.store_cache_hits,
            **(store.metrics() if store is not None else {}),
            "running": len(scheduler.running),
            "running_seqs": scheduler.num_running_seqs,
            "waiting": len(scheduler.waiting) + queued,
            "time_to_first_token_seconds": self.ttft.as_dict(),
            "inter_token_latency_seconds": self.itl.as_dict(),
            "e2e_request_latency_seconds": self.e2e.as_dict(),
        }
