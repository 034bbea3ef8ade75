"""What a preempted sequence's KV becomes, under the manager's `preemption_mode`.

`recompute`: it is cached like a finished sequence's. `swap`: it is cached, moved to the host
tier at once and pinned there for its owner until the owner is admitted again (`swap_in`), so
resumption loads all of it and recomputes nothing.
"""

from __future__ import annotations

from radixkv.cache.block_table import BlockTable
from radixkv.cache.salt import salted


class KVPreemption:
    """Mixed into `KVCacheManager`, which holds `preemption_mode`, `cache`, the owners' swapped
    paths (`_swapped`) and the swap counters."""

    def preempt(self, table: BlockTable, tokens: list[int], num_computed: int | None = None) -> None:
        """Caches and releases a preempted sequence's table; in `swap` mode also moves its
        computed KV to the host tier and pins it there for the owner (see `swap_in`).
        `num_computed` as in `cache_finished`."""
        computed = table.num_tokens if num_computed is None else num_computed
        owner, offset = table.owner, table.key_offset
        self.cache_finished(table, tokens, computed)
        if self.preemption_mode == "swap" and owner is not None and computed:
            node, moved = self.cache.swap_out(salted(tokens[:computed], offset))
            self.num_swapped_out_blocks += moved
            if node is not None:
                self._swapped.setdefault(owner, []).append(node)

    def swap_in(self, owner: object) -> None:
        """The owner was admitted again (its tables matched and loaded its swapped KV): the
        pins that kept that KV on the host are released."""
        for node in self._swapped.pop(owner, ()):
            self.cache.unpin(node)
        self.num_swapped_in_blocks += sum(
            self.blocks_for(t.num_loaded_tokens) for t in self._live.get(owner, ())
        )
