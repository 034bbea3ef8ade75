"""One forward step over the paged KV cache: chunks of sequences in, float32 logits out.

The batch is flattened into one row, as in vLLM's transformers backend: the new tokens of every
sequence are concatenated into `input_ids [1, T]` with their own `position_ids [1, T]`, and the
transformers model runs unchanged except for attention (`paged_attention_backend`), which writes
each layer's new K/V into the cache and attends through the block tables. Only the rows that need
logits go through `lm_head`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from radixkv import kernels
from radixkv.model.attention_backend import PAGED_ATTENTION, PagedBatch
from radixkv.model.host_kv import HostKVCache
from radixkv.model.loader import LoadedModel


@dataclass(slots=True)
class SequenceChunk:
    """One sequence's work in one step.

    `token_ids` are the new tokens whose KV is computed now, starting at position `start_pos`
    (= tokens already in this sequence's KV cache). `block_table` lists physical blocks covering
    positions `[0, start_pos + len(token_ids))`. `logits` picks the rows returned: the last new
    token (`"last"`), every new token (`"all"`) or none (`"none"`, a prefill chunk mid-prompt).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    logits: Literal["last", "all", "none"] = "last"


class StepInputs(NamedTuple):
    """Device tensors of one step: the flattened batch as one row and the rows that get logits."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logit_rows: torch.Tensor
    paged_batch: PagedBatch


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block: K and V, of every layer, for `block_size` tokens."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class ModelRunner:
    """Owns the KV cache of one model and runs forward steps over it.

    The cache is one K and one V tensor per layer, `[num_blocks, block_size, Hkv, D]` in the
    model's dtype, allocated once and zeroed. The runner allocates no blocks: callers give block
    tables that already cover the new tokens. Building a runner binds the model's attention to the
    paged cache (`set_attn_implementation`); a plain transformers forward needs a copy made before.
    """

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, num_host_blocks: int = 0
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.loaded = loaded
        self.model = loaded.model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = loaded.device
        shape = (num_blocks, block_size, loaded.num_kv_heads, loaded.head_dim)
        layers = range(loaded.num_layers)
        self.k_caches = [torch.zeros(shape, dtype=loaded.dtype, device=self.device) for _ in layers]
        self.v_caches = [torch.zeros(shape, dtype=loaded.dtype, device=self.device) for _ in layers]
        self.host = HostKVCache(num_host_blocks, self.k_caches + self.v_caches) if num_host_blocks else None
        self.model.set_attn_implementation(PAGED_ATTENTION)

    @torch.inference_mode()
    def forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """Compute and cache the chunks' KV; return float32 logits `[rows, vocab]`, rows in chunk order.

        Raises ValueError for an empty chunk, a block table too short for its tokens, a block id
        outside the cache or a sequence longer than the model's `max_model_len`.
        """
        if not chunks:
            raise ValueError("forward needs at least one SequenceChunk")
        step = self._build_batch(chunks)
        output = self.model(
            input_ids=step.input_ids,
            position_ids=step.position_ids,
            use_cache=False,
            logits_to_keep=step.logit_rows,
            paged_batch=step.paged_batch,
        )
        return output.logits[0].float()

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks `src[i] -> dst[i]` in every layer's K and V cache (copy-on-write).

        The pairs are copied in parallel, so destinations must be distinct and not among the sources.
        """
        if len(src) != len(dst):
            raise ValueError(f"copy_blocks got {len(src)} sources but {len(dst)} destinations")
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise ValueError(f"copy_blocks destinations must be distinct and not sources, got {src} -> {dst}")
        if not src:
            return
        self._check_block_ids(src + dst)
        src_t = torch.tensor(src, dtype=torch.int32, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.int32, device=self.device)
        for k_cache, v_cache in zip(self.k_caches, self.v_caches, strict=True):
            kernels.copy_blocks(k_cache, v_cache, src_t, dst_t)

    def offload(self, src: list[int], dst: list[int]) -> None:
        """Copy device blocks `src[i]` to host blocks `dst[i]` (the host tier), every layer."""
        self._check_block_ids(src)
        self.host.offload(self.k_caches + self.v_caches, src, dst)

    def load(self, src: list[int], dst: list[int]) -> None:
        """Copy host blocks `src[i]` back to device blocks `dst[i]`, every layer."""
        self._check_block_ids(dst)
        self.host.load(self.k_caches + self.v_caches, src, dst)

    def _build_batch(self, chunks: list[SequenceChunk]) -> StepInputs:
        """Host-side metadata for one step, built on the CPU and moved to the device once."""
        bs = self.block_size
        max_len = self.loaded.max_model_len
        token_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        seq_lens: list[int] = []
        for i, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            end = chunk.start_pos + n
            if n == 0:
                raise ValueError(f"chunk {i} has no new tokens")
            if len(chunk.block_table) * bs < end:
                raise ValueError(
                    f"chunk {i}: {len(chunk.block_table)} blocks of {bs} cannot hold its {end} positions"
                )
            if end > max_len:
                raise ValueError(f"chunk {i} reaches {end} tokens, over max_model_len {max_len}")
            row = len(token_ids)
            if chunk.logits == "last":
                logit_rows.append(row + n - 1)
            elif chunk.logits == "all":
                logit_rows.extend(range(row, row + n))
            elif chunk.logits != "none":
                raise ValueError(f"chunk {i}: logits must be 'last', 'all' or 'none', got {chunk.logits!r}")
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, end))
            seq_lens.append(end)
        max_blocks = max(len(chunk.block_table) for chunk in chunks)
        tables = [chunk.block_table + [0] * (max_blocks - len(chunk.block_table)) for chunk in chunks]
        self._check_block_ids([b for chunk in chunks for b in chunk.block_table])

        pos = torch.tensor(positions, dtype=torch.int64)
        block_table = torch.tensor(tables, dtype=torch.int32)
        q_lens = torch.tensor([len(chunk.token_ids) for chunk in chunks])
        owner = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
        slot_mapping = block_table[owner, pos // bs].long() * bs + pos % bs
        query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.cumsum(q_lens, 0)

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True)

        batch = PagedBatch(
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            slot_mapping=to_device(slot_mapping),
            block_table=to_device(block_table),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            query_start_loc=to_device(query_start_loc),
        )
        return StepInputs(
            input_ids=to_device(torch.tensor(token_ids, dtype=torch.int64)).unsqueeze(0),
            position_ids=to_device(pos).unsqueeze(0),
            logit_rows=to_device(torch.tensor(logit_rows, dtype=torch.int64)),
            paged_batch=batch,
        )

    def _check_block_ids(self, blocks: list[int]) -> None:
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {min(blocks)}..{max(blocks)}")
