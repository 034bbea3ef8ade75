"""The attention function that plugs radixkv's paged KV cache into transformers' model code.

transformers calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` inside every attention
layer, after the q/k/v projections and rotary embeddings, with query `[1, Hq, T, D]` and key/value
`[1, Hkv, T, D]` for the flattened batch, the layer's `scaling`, and every extra keyword argument
given to the model's forward. `ModelRunner` passes a `PagedBatch` as `paged_batch`; this function
stores the new K/V of `module.layer_idx` and attends over the block tables. Because the name is not
registered with transformers' `AttentionMaskInterface`, the model builds no dense causal mask
(`attention_mask` arrives as None): the kernel's causality comes from `seq_lens` alone, a layer's
sliding window from `PagedBatch.windows` (the window transformers' mask would apply, which some
models do not pass as an argument), and Gemma 2's logit cap from the layer's `softcap` argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from radixkv.kernels import AttentionLaunches, paged_attention, store_kv
from radixkv.model.layered_load import LayeredLoad

PAGED_ATTENTION = "radixkv_paged"


@dataclass(slots=True)
class PagedBatch:
    """Everything attention needs for one step, shared by all layers (device tensors).

    `slot_mapping[t]` is `block * block_size + offset` of new token t; `block_table`, `seq_lens`
    and `query_start_loc` have the meanings of `radixkv.kernels.paged_attention`; `launches` is
    its plan for this batch, made once per step (`plan_paged_attention`) rather than per layer.
    `k_scales[layer]`, `v_scales[layer]` are a quantized cache's scales (None: not quantized).
    `load`, when set, holds the step's host-tier loads: each layer waits for its own part of them
    before it touches its cache (`radixkv.model.layered_load`). `windows[layer]` is that layer's
    sliding window (None: full causal attention), `LoadedModel.layer_windows`. With KV groups
    (`radixkv.cache.kv_groups`), layer l reads and writes through `group_tables[group_of[l]]`
    and `group_slots[group_of[l]]` instead (group 0's are `block_table` and `slot_mapping`).
    """

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    k_scales: list[torch.Tensor] | None
    v_scales: list[torch.Tensor] | None
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    launches: AttentionLaunches
    windows: tuple[int | None, ...]
    load: LayeredLoad | None = None
    group_of: tuple[int, ...] | None = None
    group_tables: tuple[torch.Tensor, ...] = ()
    group_slots: tuple[torch.Tensor, ...] = ()


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_batch: PagedBatch | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Store this layer's new K/V and attend over the paged cache; returns `[1, T, Hq, D]`, None.

    `attention_mask`, `dropout` (always 0 in eval) and `sliding_window` in `kwargs` are ignored:
    the mask is implied by `seq_lens` and the window is `paged_batch.windows[layer]`. `softcap`
    (Gemma 2's `attn_logit_softcapping`) caps the logits in the kernel.
    """
    if paged_batch is None:
        raise RuntimeError(
            "this model's attention is bound to a radixkv ModelRunner and needs its paged_batch; "
            "run it through ModelRunner.forward, or run a copy of the model made before binding"
        )
    layer = module.layer_idx
    if paged_batch.load is not None:  # this layer's loaded blocks are in before we store or read
        paged_batch.load.wait(layer)
    k_cache, v_cache = paged_batch.k_caches[layer], paged_batch.v_caches[layer]
    block_table, slot_mapping = paged_batch.block_table, paged_batch.slot_mapping
    if paged_batch.group_of is not None:
        group = paged_batch.group_of[layer]
        block_table, slot_mapping = paged_batch.group_tables[group], paged_batch.group_slots[group]
    scales = {}
    if paged_batch.k_scales is not None:
        scales = {"k_scale": paged_batch.k_scales[layer], "v_scale": paged_batch.v_scales[layer]}
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, slot_mapping, **scales)
    out = paged_attention(
        query[0].transpose(0, 1),
        k_cache,
        v_cache,
        block_table,
        paged_batch.seq_lens,
        paged_batch.query_start_loc,
        scale=scaling,
        launches=paged_batch.launches,
        window=paged_batch.windows[layer],
        softcap=softcap,
        **scales,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
