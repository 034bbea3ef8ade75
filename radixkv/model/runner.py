"""One forward step over the paged KV cache: chunks of sequences in, float32 logits out.

The batch is flattened into one row, as in vLLM's transformers backend: the new tokens of every
sequence are concatenated into `input_ids [1, T]` with their own `position_ids [1, T]`, and the
transformers model runs unchanged except for attention (`paged_attention_backend`), which writes
each layer's new K/V into the cache and attends through the block tables. Only the rows that need
logits go through `lm_head`.
"""

from __future__ import annotations

import torch

from radixkv import kernels
from radixkv.cache.kv_groups import KVGroups, kv_groups
from radixkv.kernels import AttentionLaunches, plan_paged_attention
from radixkv.model.attention_backend import PAGED_ATTENTION, PagedBatch
from radixkv.model.cuda_graphs import DecodeGraphs
from radixkv.model.host_kv import HostKVCache
from radixkv.model.kv_layout import KVLayout
from radixkv.model.layered_load import LayeredLoad, send
from radixkv.model.loader import LoadedModel
from radixkv.model.persistent_batch import HostBatch, PersistentBatch
from radixkv.model.stored_kv import block_payloads, gather_blocks, stage_payloads
from radixkv.scheduler.chunk import SequenceChunk


def kv_block_bytes(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes of one block: K and V, of every layer, for `block_size` tokens, scales included when
    `kv_cache_dtype` quantizes (`radixkv.model.kv_layout`). With KV groups a block holds one
    group's layers: pass `KVGroups.layers_per_group`."""
    return KVLayout(kv_cache_dtype, dtype, block_size, num_kv_heads, head_dim).block_bytes(num_layers)


class ModelRunner:
    """Owns the KV cache of one model and runs forward steps over it.

    The cache is one zeroed tensor `[2, num_layers, num_blocks, block_size, Hkv, D]` in the model's
    dtype, or with `kv_cache_dtype` int8 / fp8_e4m3 `[2, num_layers, num_blocks, 1, 1, row_bytes]`
    of quantized values and their scales (`radixkv.model.kv_layout`): `k_caches[l]` and
    `v_caches[l]` are its per-layer views in the kernels' layout (`k_scales[l]`, `v_scales[l]` the
    scales', None unquantized), and the
    flattened `[num_layers * num_blocks, ...]` view lets one `copy_blocks` launch copy a block in
    every layer. With KV groups (`groups`, `radixkv.cache.kv_groups`: layers of different
    windows; None is one group of every layer) it is `[2, layers_per_group, num_blocks, ...]`: a
    block holds one group's layers, layer l in slot `slot[l]` of the blocks its group's table
    lists, and each group has its own block table and slot mapping in the step (no host tier
    then: its transfers move every layer of a block). The runner allocates
    no blocks: callers give block tables that already cover the new tokens. A step's inputs
    come from a `PersistentBatch` (one host-to-device copy) and its attention launches are
    planned once and shared by all layers. Building a runner binds the model's attention to the
    paged cache (`set_attn_implementation`); a plain transformers forward needs a copy made
    before. On CUDA, with `cuda_graph_max_seqs` > 0, decode steps of up to that many sequences
    replay captured CUDA graphs (`radixkv.model.cuda_graphs`).

    Host-tier loads are staged when `load` is called and written into the cache during the next
    forward, layer by layer, each layer before its attention (`radixkv.model.layered_load`; on
    CUDA on the side stream `load_stream`). Until then they are this runner's `pending_load`: a
    copy-on-write copy that touches their blocks joins it, an offload that reads their blocks
    finishes it first, and a forward that replays a CUDA graph finishes it before the replay.
    A forward that fails still finishes it (the cache's books count on the data); if that
    fails too, it stays pending and the next forward resumes it where it stopped.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        cuda_graph_max_seqs: int = 0,
        groups: KVGroups | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.loaded = loaded
        self.model = loaded.model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = loaded.device
        # transformers' config attributes cost microseconds each to read; read them once
        self.num_heads = loaded.config.num_attention_heads
        self.num_kv_heads = loaded.num_kv_heads
        self.head_dim = loaded.head_dim
        self.windows = loaded.layer_windows
        self.groups = groups if groups is not None else kv_groups(self.windows, split=False)
        if self.groups.num_groups > 1 and num_host_blocks:
            raise ValueError("a host KV tier moves every layer of a block: it needs one KV group")
        self.layout = KVLayout(kv_cache_dtype, loaded.dtype, block_size, loaded.num_kv_heads, loaded.head_dim)
        self.kv_cache = self.layout.allocate(self.groups.layers_per_group, num_blocks, self.device)
        k_slots = [self.layout.views(c) for c in self.kv_cache[0].unbind(0)]
        v_slots = [self.layout.views(c) for c in self.kv_cache[1].unbind(0)]
        self.k_caches = [k_slots[j][0] for j in self.groups.slot]
        self.v_caches = [v_slots[j][0] for j in self.groups.slot]
        quantized = self.layout.quantized
        self.k_scales = [k_slots[j][1] for j in self.groups.slot] if quantized else None
        self.v_scales = [v_slots[j][1] for j in self.groups.slot] if quantized else None
        self.closed = False
        self.batch = PersistentBatch(
            num_blocks, block_size, loaded.max_model_len, self.device, self.groups.num_groups
        )
        self.host = HostKVCache(num_host_blocks, self.kv_cache) if num_host_blocks else None
        self.model.set_attn_implementation(PAGED_ATTENTION)
        use_graphs = cuda_graph_max_seqs > 0 and self.device.type == "cuda"
        self.graphs = DecodeGraphs(self, cuda_graph_max_seqs) if use_graphs else None
        on_cuda = self.device.type == "cuda"  # the side stream of host-tier and store loads
        self.load_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.store = None  # the engine's KVStore, when it has one (`save`, `fetch`)
        self.pending_load: LayeredLoad | None = None
        self.last_load: LayeredLoad | None = None  # the last finished one, with its staging
        self.num_layered_loads = 0  # forwards that wrote their loads layer by layer
        self.num_early_loads = 0  # loads finished before their forward (an offload, a graph replay)
        if self.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """Compiles the step's kernels before the first request: a prefill forward, a block copy,
        then every decode graph (`DecodeGraphs.capture_all`). Otherwise the first step of each new
        shape stalls every request in flight for a Triton compile (about a second each; Triton's
        disk cache makes later starts quicker). Eager decodes (`enforce_eager`, or after a failed
        capture) still compile their plan on first use. The prefill writes into block 0
        and the copy into block 1, both free at start: a block's slots are always stored before
        they are read."""
        first = SequenceChunk([0] * min(self.block_size, 2), 0, [0], group_tables=self.scratch_groups([0]))
        self.forward([first])
        if self.num_blocks > 1:
            self.copy_blocks([0], [1])
        if self.graphs is not None:
            self.graphs.capture_all()

    def scratch_groups(self, table: list[int]) -> list[list[int]]:
        """Group tables for a forward whose KV is never read back: every group writes `table`'s
        blocks (over each other's layers)."""
        return [table] * (self.groups.num_groups - 1)

    def close(self) -> None:
        """Frees the KV cache, device and host (pinned) alike, the step buffers and the CUDA
        graphs' memory; a later forward raises RuntimeError. Idempotent."""
        self.closed = True
        self.kv_cache = self.k_caches = self.v_caches = self.k_scales = self.v_scales = None
        self.host = self.graphs = self.pending_load = self.last_load = None
        self.batch = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Compute and cache the chunks' KV; return float32 logits `[rows, vocab]`, rows in chunk order.

        Raises ValueError for an empty chunk, a block table too short for its tokens, a block id
        outside the cache or a sequence longer than the model's `max_model_len`, and
        RuntimeError once the runner is closed.
        """
        return self.execute(self.prepare(chunks))

    def prepare(self, chunks: list[SequenceChunk]) -> HostBatch:
        """The first half of `forward`: the chunks' inputs, built on the host and sent to the
        device, with their attention launches planned (but for a step a CUDA graph replays, which
        plans its own). With host/device overlap the engine prepares a step while the one before
        runs, so that the forward that follows it starts at once."""
        if self.closed:
            raise RuntimeError("the model runner is closed")
        step = self.batch.prepare(chunks)
        if self.graphs is None or not self.graphs.fits(step):
            step = step._replace(launches=self._plan(step))
        return step

    @torch.inference_mode()
    def execute(self, step: HostBatch) -> torch.Tensor:
        """The second half of `forward`: runs the model on prepared inputs (the pending loads
        written layer by layer); returns the logits."""
        if self.closed:
            raise RuntimeError("the model runner is closed")
        load = self.pending_load
        try:
            if self.graphs is not None and self.graphs.fits(step):
                if load is not None:  # a replay reads every layer, without calling back here
                    self._finish_early()
                    load = None
                return self.graphs.run(step)
            if load is not None:
                load.start()
                self.num_layered_loads += 1
            output = self.model(
                input_ids=step.input_ids,
                position_ids=step.position_ids,
                use_cache=False,
                logits_to_keep=step.logit_rows,
                paged_batch=self.paged_batch(step, load),
            )
            return output.logits[0].float()
        finally:
            if load is not None:
                load.finish()
                self.pending_load, self.last_load = None, load

    def paged_batch(self, step: HostBatch, load: LayeredLoad | None = None) -> PagedBatch:
        """What every layer's attention reads for `step`, its launches planned once a step (by
        `prepare`, else here); `load` is waited for layer by layer."""
        launches = step.launches if step.launches is not None else self._plan(step)
        return PagedBatch(
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            k_scales=self.k_scales,
            v_scales=self.v_scales,
            slot_mapping=step.slot_mapping,
            block_table=step.block_table,
            seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc,
            launches=launches,
            windows=self.windows,
            load=load,
            group_of=self.groups.group if step.group_tables else None,
            group_tables=(step.block_table, *step.group_tables) if step.group_tables else (),
            group_slots=(step.slot_mapping, *step.group_slots) if step.group_tables else (),
        )

    def _plan(self, step: HostBatch) -> AttentionLaunches:
        return plan_paged_attention(
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            num_tokens=step.input_ids.shape[1],
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            itemsize=self.kv_cache.element_size(),
        )

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i] -> dst[i]` in every layer's K and V cache (copy-on-write), in
        one kernel launch over the flattened cache, with the ids sent to the device in one copy.

        The pairs are copied in parallel, so destinations must be distinct and not among the sources.
        """
        if len(src) != len(dst):
            raise ValueError(f"copy_blocks got {len(src)} sources but {len(dst)} destinations")
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise ValueError(f"copy_blocks destinations must be distinct and not sources, got {src} -> {dst}")
        if not src:
            return
        blocks = src + dst
        self._check_block_ids(blocks)
        if self.pending_load is not None and self.pending_load.conflicts(src, dst):
            self.pending_load.add_copy(src, dst)  # it reads or overwrites the step's loaded blocks
            return
        num_layers = self.kv_cache.shape[1]
        offsets = torch.arange(num_layers, dtype=torch.int64, device="cpu").view(1, -1, 1) * self.num_blocks
        # [2, layers, pairs] -> rows src and dst, each layer after layer; contiguous for the kernel.
        ids = (torch.tensor(blocks, dtype=torch.int64, device="cpu").view(2, 1, -1) + offsets).view(2, -1)
        ids = send(ids, self.device)
        # Whole blocks as stored: a quantized block's row of bytes carries its scales with it.
        k_flat, v_flat = self.kv_cache[0].flatten(0, 1), self.kv_cache[1].flatten(0, 1)
        kernels.copy_blocks(k_flat, v_flat, ids[0], ids[1])

    def offload(self, src: list[int], dst: list[int]) -> None:
        """Copy device blocks `src[i]` to host blocks `dst[i]` (the host tier), every layer, now;
        pending loads into any of `src` are finished first."""
        self._check_block_ids(src)
        if self.pending_load is not None and self.pending_load.writes_any(src):
            self._finish_early()
        self.host.offload(self.kv_cache, src, dst)

    def load(self, src: list[int], dst: list[int]) -> None:
        """Copy host blocks `src[i]` back to device blocks `dst[i]`, every layer: the host blocks
        are read now, the device blocks written during the next forward (see the class)."""
        self._check_block_ids(dst)
        if not src:
            return
        if self.pending_load is None:
            self.pending_load = LayeredLoad(self.kv_cache, self.load_stream)
        self.pending_load.add_load(self.host.stage(src), dst)

    @torch.inference_mode()
    def save(self, src: list[int], keys: list[bytes]) -> None:
        """Copies device blocks `src` to the host now and queues them for the KV store under
        `keys`; when the store's write queue has no room, copies nothing (the store counts the
        dropped writes). Pending loads into any of `src` are finished first. A failure here
        loses these writes only: it never fails the step (nothing in the cache waits on them)."""
        if not src or not self.store.has_room(len(src)):
            return
        self._check_block_ids(src)
        if self.pending_load is not None and self.pending_load.writes_any(src):
            self._finish_early()
        try:
            rows = gather_blocks(self.kv_cache, src)
        except Exception as exc:
            self.store.lost(len(src), exc)
            return
        self.store.save(keys, lambda: block_payloads(rows))

    def fetch(self, src: list, dst: list[int]) -> None:
        """Writes blocks fetched from the KV store (`StoredBlock`s) into device blocks `dst`,
        layer by layer during the next forward, as `load` does."""
        self._check_block_ids(dst)
        if not src:
            return
        if self.pending_load is None:
            self.pending_load = LayeredLoad(self.kv_cache, self.load_stream)
        self.pending_load.add_load(stage_payloads([b.payload for b in src], self.kv_cache), dst)

    def finish_loads(self) -> None:
        """Completes the pending loads now, without a forward (the engine is closing)."""
        if self.pending_load is not None:
            self._finish_early()

    @torch.inference_mode()
    def _finish_early(self) -> None:
        self.pending_load.finish()
        self.pending_load, self.last_load = None, self.pending_load
        self.num_early_loads += 1

    def _check_block_ids(self, blocks: list[int]) -> None:
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {min(blocks)}..{max(blocks)}")
