"""Paged attention: the new tokens of a ragged batch attend to their sequences' KV through a block table.

One launch serves decode (one new token), prefill (no cached prefix) and extend (new tokens after a
cached prefix) together. New token j of a sequence with q_len new tokens and seq_len tokens in all
sits at position seq_len - q_len + j and attends to every position up to and including its own.

Work is cut into items: `block_q` consecutive new tokens of one sequence times the query heads that
share one KV head (so K and V are read once per item, whatever the GQA ratio). A program takes
`items` items as the batch dimension of every tile (q [items, rows, D], K/V [items, block_n, D],
scores [items, rows, block_n]) and walks their keys `block_n` at a time, gathering K/V rows through
the block table, with the online softmax in float32 (exp2 on pre-scaled scores). Key steps that lie
below every item's first query position skip the causal mask. A sliding window (per call, so per
layer) starts the walk at the lowest key any item's window reaches and masks keys before each
row's window; a logit cap is applied to the scores before the mask. With split-KV each program covers one
range of keys and a second kernel merges the ranges by their log-sum-exp.

A quantized cache (int8 or float8_e4m3fn, one scale per token and KV head) is read as stored, in 8
bits, and its scales are folded into the arithmetic: each score is q . k_stored times its key's K
scale, and each probability is multiplied by its key's V scale before the product with the stored
V. No dequantized copy of a block exists anywhere.

Reductions call tl.reduce with triton.language.standard's own combine functions rather than tl.max
and tl.sum (which do just that): those two are jit functions, built compiled-only because radixkv
never sets TRITON_INTERPRET (it interprets per launch, radixkv.kernels.dispatch), which an
interpreted kernel cannot call, and which cost 0.25 ms a call in the interpreter.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from radixkv.kernels import scale_code
from radixkv.kernels.checks import check_cache, check_index, check_kernel_device, check_same_device
from radixkv.kernels.dispatch import interpreted, launch_guard
from radixkv.kernels.launch_plan import (
    AttentionPlan,
    max_tiles,
    next_power_of_2,
    padded_group,
    padded_head_dim,
    plan_attention_gpu,
    plan_attention_interpreted,
)
from radixkv.kernels.paged_attention_kernel import merge_splits_kernel, paged_attention_kernel

LOG2E = 1.4426950408889634

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True, slots=True)
class AttentionLaunches:
    """The launches of one paged-attention call: each plan with its tiles (`tile_seq`, `tile_start`,
    as `_tile_map` returns them). They depend on the batch's lengths and the heads' shapes only, not
    on the layer, so a model step plans once (`plan_paged_attention`) and every layer reuses them."""

    launches: tuple[tuple[AttentionPlan, torch.Tensor, torch.Tensor], ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    interpreted: bool


def plan_paged_attention(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    itemsize: int = 4,
) -> AttentionLaunches:
    """Plan the launches for a batch (arguments as in `paged_attention`; `num_tokens` is q's length,
    `itemsize` the bytes of a cache element, which bounds a GPU prefill tile's stages).

    On a GPU, planned from shapes only, the tile maps computed on the device (no sync, capturable
    in a CUDA graph): a decode batch is one launch; any other is two, the decode plan over its
    sequences with one new token and the prefill plan (`prefill_tile`) over the rest, so that
    a decode beside a prefill does not fill a prefill tile's rows with one token. Under the
    interpreter one or two launches, planned from the lengths read on the host (free there; see
    _interpreter_launches).
    """
    device = seq_lens.device
    interp = interpreted(device)
    group = num_heads // num_kv_heads
    launches = []
    if interp:
        for plan, seqs in _interpreter_launches(query_start_loc, seq_lens, num_kv_heads, group, head_dim):
            launches.append((plan, *_tile_map(query_start_loc, seq_lens, seqs, plan.block_q, None)))
    else:
        num_seqs = seq_lens.shape[0]
        capacity = block_table.shape[1] * block_size
        shape = (num_kv_heads, group, head_dim, capacity, itemsize)
        decode = plan_attention_gpu(device, num_seqs, num_seqs, *shape)
        if num_tokens == num_seqs:
            launches.append((decode, *_tile_map(query_start_loc, seq_lens, None, decode.block_q, num_seqs)))
        else:
            prefill = plan_attention_gpu(device, num_tokens, num_seqs, *shape)
            one = (query_start_loc[1:] - query_start_loc[:-1]) == 1
            num_tiles = max_tiles(num_tokens, num_seqs, prefill.block_q)
            for plan, seqs, tiles in ((decode, one, num_seqs), (prefill, ~one, num_tiles)):
                launches.append((plan, *_tile_map(query_start_loc, seq_lens, seqs, plan.block_q, tiles)))
    return AttentionLaunches(tuple(launches), num_heads, num_kv_heads, head_dim, interp)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    launches: AttentionLaunches | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the batch's new tokens over their paged KV; returns [T, Hq, D] in q's dtype.

    q: [T, Hq, D], the new tokens of all sequences, concatenated. k_cache, v_cache:
    [num_blocks, block_size, Hkv, D], one layer, with the new tokens' K/V already stored; Hq % Hkv == 0.
    block_table: [S, max_blocks]; seq_lens: [S], each sequence's length including its new tokens;
    query_start_loc: [S + 1], cumulative new-token counts (int32 or int64). scale defaults to
    1/sqrt(D). The result is written into `out` when given. `launches`, from `plan_paged_attention`
    over the same batch, saves planning again (a model's layers share one plan per step).

    `window` (a sliding window, as transformers masks it): the token at position p sees only keys
    at positions > p - window, `window` keys with its own; blocks wholly before every new token's
    window are never read, so their table entries need not be valid. `softcap` caps each logit
    (after the scale) as `softcap * tanh(logit / softcap)` before the softmax (Gemma 2). None: no
    window, no cap. `k_scale`, `v_scale` ([num_blocks, block_size, Hkv], as `store_kv` writes
    them): the caches are int8 or float8_e4m3fn, key j standing for k_cache[j] * k_scale[j] (the
    scales in float16, float32, or uint8 codes of radixkv.kernels.scale_code); q is then in any
    float dtype, and so is the result.

    Thread-safe. Compiled on CUDA tensors, interpreted on CPU tensors (radixkv.kernels.dispatch).
    """
    _check_attention_args(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, k_scale, v_scale)
    if window is not None and window < 1:
        raise ValueError(f"window must be None (no window) or >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None (no cap) or > 0, got {softcap}")
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    shapes = (num_heads, num_kv_heads, head_dim)
    if launches is None:
        launches = plan_paged_attention(
            query_start_loc,
            seq_lens,
            block_table,
            num_tokens=num_tokens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=k_cache.shape[1],
            itemsize=k_cache.element_size(),
        )
    elif (launches.num_heads, launches.num_kv_heads, launches.head_dim) != shapes:
        raise ValueError(
            f"launches were planned for {launches.num_heads} heads over {launches.num_kv_heads} KV heads of "
            f"size {launches.head_dim}, but q and k_cache have {num_heads}, {num_kv_heads}, {head_dim}"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    batch = (q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    for plan, tile_seq, tile_start in launches.launches:
        _launch(plan, tile_seq, tile_start, *batch, scale, out, window, softcap, k_scale, v_scale)
    return out


def launch_attention(
    plan: AttentionPlan,
    seqs: torch.Tensor | None,
    num_tiles: int | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """One launch with an explicit plan over the tiles of the sequences in the bool mask `seqs` (all
    when None), then the merge of the KV splits; `num_tiles` as in _tile_map. Arguments are not
    checked. paged_attention picks the plans; tests call this to run every plan shape, the GPU's
    included, through the interpreter."""
    tile_seq, tile_start = _tile_map(query_start_loc, seq_lens, seqs, plan.block_q, num_tiles)
    batch = (q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
    _launch(plan, tile_seq, tile_start, *batch, scale, out, window, softcap, k_scale, v_scale)


def _launch(
    plan: AttentionPlan,
    tile_seq: torch.Tensor,
    tile_start: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None,
    softcap: float | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_items = tile_seq.shape[0] * num_kv_heads
    if num_items == 0:
        return
    capacity = block_table.shape[1] * k_cache.shape[1]
    kv_per_split = triton.cdiv(triton.cdiv(capacity, plan.num_splits), plan.block_n) * plan.block_n
    split = plan.num_splits > 1
    if split:
        target = torch.empty((plan.num_splits, *q.shape), dtype=torch.float32, device=q.device)
        lse = torch.empty((plan.num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        split_strides = (target.stride(0), lse.stride(0), lse.stride(1))
    else:
        target, lse, split_strides = out, out, (0, 0, 0)
    quantized = k_scale is not None
    # Without scales the scale pointers and strides are never read: the cache stands in for them.
    scales = (k_scale, v_scale, *k_scale.stride()) if quantized else (k_cache, v_cache, 0, 0, 0)
    device = q.device
    interp = interpreted(device)
    # The interpreter multiplies in numpy, which has no bfloat16; float32 dots on a GPU stay IEEE.
    dot_dtype = tl.float32 if interp else _TL_DTYPES[q.dtype]
    with launch_guard():
        paged_attention_kernel.on(device)[(triton.cdiv(num_items, plan.items), plan.num_splits)](
            q,
            k_cache,
            v_cache,
            *scales[:2],
            target,
            lse,
            block_table,
            seq_lens,
            query_start_loc,
            tile_seq,
            tile_start,
            scale if softcap else scale * LOG2E,
            2 * LOG2E / softcap if softcap else 0.0,
            softcap * LOG2E if softcap else 0.0,
            window or 0,
            num_items,
            kv_per_split,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            *scales[2:],
            split_strides[0],
            target.stride(-3),
            target.stride(-2),
            split_strides[1],
            split_strides[2],
            block_table.stride(0),
            NUM_KV_HEADS=num_kv_heads,
            GROUP=group,
            GROUP_P=padded_group(group),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=padded_head_dim(head_dim),
            BLOCK_SIZE=k_cache.shape[1],
            ITEMS=plan.items,
            BLOCK_Q=plan.block_q,
            BLOCK_N=plan.block_n,
            NUM_SPLITS=plan.num_splits,
            FLAT_LOADS=plan.flat_loads,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
            WINDOW=window is not None,
            SOFTCAP=softcap is not None,
            OUT_LIKE_Q=target.stride()[-3:-1] == q.stride()[:2],
            QUANTIZED=quantized,
            CODED=quantized and k_scale.dtype == scale_code.SCALE_CODE_DTYPE,
            CODE_BIAS=scale_code.CODE_BIAS,
            CODE_SHIFT=scale_code.SHIFT,
            num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )
        if split:
            merge_splits_kernel.on(device)[(num_tokens * num_heads,)](
                target,
                lse,
                out,
                num_heads,
                target.stride(0),
                target.stride(1),
                target.stride(2),
                lse.stride(0),
                lse.stride(1),
                out.stride(0),
                out.stride(1),
                NUM_SPLITS=plan.num_splits,
                HEAD_DIM=head_dim,
                HEAD_DIM_P=next_power_of_2(head_dim),
            )


def _interpreter_launches(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int, group: int, head_dim: int
) -> list[tuple[AttentionPlan, np.ndarray | None]]:
    """The interpreter's launches (plan, bool mask of their sequences or None for all), planned from
    the batch's lengths, read on the host with numpy (torch's small CPU ops cost 10-20 us each here).

    One launch when one program and one key step cover the whole batch: the launch's fixed cost
    (about 220 interpreter ops, 10 ms here) then dominates. Otherwise decode sequences and the
    others get a launch each, since one tile shape would waste most of its rows on one of them.
    """
    qsl, lens = _host(query_start_loc), _host(seq_lens)
    q_lens = qsl[1:] - qsl[:-1]

    def plan_for(seqs: np.ndarray) -> tuple[AttentionPlan, bool]:
        num_items = int(seqs.sum()) * num_kv_heads
        max_q_len, max_kv_len = int(q_lens[seqs].max()), int(lens[seqs].max())
        plan = plan_attention_interpreted(num_items, max_q_len, max_kv_len, group, head_dim)
        return plan, num_items <= plan.items and max_q_len <= plan.block_q and max_kv_len <= plan.block_n

    decode, longer = q_lens == 1, q_lens > 1
    plan, one_step = plan_for(q_lens > 0)
    if one_step or not decode.any() or not longer.any():
        return [(plan, None)]
    return [(plan_for(decode)[0], decode), (plan_for(longer)[0], longer)]


def _tile_map(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    seqs: torch.Tensor | np.ndarray | None,
    block_q: int,
    num_tiles: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and first new-token index (into q) of each tile of `block_q` new tokens (int64, on
    the lengths' device).

    Only sequences in the bool mask `seqs` (all when None) get tiles. `num_tiles` None counts them on
    the host (interpreter) and orders them by the number of keys they see, most first, so that the
    items sharing a program, which all walk to the program's longest key range, see about as many.
    On a GPU the caller passes a bound from the shapes alone, so no device sync is needed (and a
    CUDA graph can capture it), and the tiles past the last start at their sequence's end and do
    nothing.
    """
    if num_tiles is None:
        qsl, lens = _host(query_start_loc), _host(seq_lens)
        first, q_end = qsl[:-1], qsl[1:]
        tiles = (q_end - first + block_q - 1) // block_q
        if seqs is not None:
            tiles = np.where(_host(seqs), tiles, 0)
        seq = np.repeat(np.arange(tiles.shape[0]), tiles)
        start = first[seq] + (np.arange(seq.shape[0]) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * block_q
        keys = lens[seq] - q_end[seq] + np.minimum(start + block_q, q_end[seq])
        order = np.argsort(-keys, kind="stable")
        device = seq_lens.device
        return torch.from_numpy(seq[order]).to(device), torch.from_numpy(start[order]).to(device)
    starts = query_start_loc[:-1].long()
    tiles = (query_start_loc[1:] - starts + block_q - 1) // block_q
    if seqs is not None:
        tiles = torch.where(torch.as_tensor(seqs, device=tiles.device), tiles, 0)
    ends = tiles.cumsum(0)
    tile = torch.arange(num_tiles, device=ends.device)
    seq = torch.searchsorted(ends, tile, right=True).clamp_(max=ends.shape[0] - 1)
    start = starts[seq] + (tile - ends[seq] + tiles[seq]) * block_q
    return seq, start


def _host(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """An index tensor's values as an int64 (or bool) numpy array; free for a CPU tensor."""
    if isinstance(t, np.ndarray):
        return t
    array = t.cpu().numpy()
    return array if array.dtype == np.bool_ else array.astype(np.int64, copy=False)


def _check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    check_cache(k_cache, v_cache, k_scale, v_scale)
    check_kernel_device("k_cache", k_cache)
    device = k_cache.device
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.stride(2) != 1:
        raise ValueError(
            f"q must be [T, Hq, D] with k_cache's D = {k_cache.shape[3]} and a contiguous last "
            f"dimension, got shape {tuple(q.shape)}"
        )
    if k_scale is not None and q.dtype not in _TL_DTYPES:
        raise ValueError(f"q dtype must be float32, float16 or bfloat16, got {q.dtype}")
    if k_scale is None and q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype must match k_cache's ({k_cache.dtype}), got {q.dtype}")
    check_same_device("q", q, device)
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"q's head count Hq={q.shape[1]} must be a multiple of k_cache's KV head count "
            f"Hkv={k_cache.shape[2]}"
        )
    check_index("block_table", block_table, (-1, -1), device)
    num_seqs = block_table.shape[0]
    check_index("seq_lens", seq_lens, (num_seqs,), device)
    check_index("query_start_loc", query_start_loc, (num_seqs + 1,), device)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(
            f"out must be like q: shape {tuple(q.shape)}, dtype {q.dtype}, contiguous last dimension; "
            f"got {tuple(out.shape)}, {out.dtype}"
        )
    if out is not None:
        check_same_device("out", out, device)
