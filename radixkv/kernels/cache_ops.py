"""KV cache writes: store the new tokens' K/V into their slots, copy whole blocks (copy-on-write).

Both move rows of elements: a token's Hkv * D values for store_kv, a block's block_size * Hkv * D
values for copy_blocks. A program moves a [rows, cols] tile of them, sized by launch_plan.plan_copy.
Into a quantized cache (int8 or float8_e4m3fn) store_kv quantizes as it writes, one program per
tile of tokens and KV head, since each token's head takes the scale of its own largest value.
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from radixkv.kernels import scale_code
from radixkv.kernels.checks import (
    QUANTIZED_DTYPES,
    check_cache,
    check_index,
    check_kernel_device,
    check_same_device,
)
from radixkv.kernels.dispatch import dual_jit, interpreted, launch_guard
from radixkv.kernels.launch_plan import padded_head_dim, plan_copy


@dual_jit(do_not_specialize=("num_tokens",))
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    ROW_LEN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    V_LIKE_K: tl.constexpr,
    HEADS_PACKED: tl.constexpr,
    SLOTS_PACKED: tl.constexpr,
):
    # The compile-time flags take the general index math out where the layout makes it the
    # identity (the usual case): every op costs the interpreter the same whatever its size.
    token = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    elem = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None]
    if ROW_LEN % COLS != 0:  # the last column tile runs past the row
        mask = mask & (elem < ROW_LEN)[None, :]
    if SLOTS_PACKED:  # a block's slots follow the last block's: slot s is row s
        slot_row = slot * stride_cs
    else:
        slot_row = slot // BLOCK_SIZE * stride_cb + slot % BLOCK_SIZE * stride_cs
    if HEADS_PACKED:  # K, V and the cache hold a token's heads back to back: elem is the offset
        k_inner = elem
        v_inner = elem
        dst_inner = elem
    else:
        head, d = elem // HEAD_DIM, elem % HEAD_DIM
        k_inner = head * stride_kh + d
        v_inner = head * stride_vh + d
        dst_inner = head * stride_ch + d
    dst = slot_row[:, None] + dst_inner[None, :]
    k_src = token[:, None] * stride_kt + k_inner[None, :]
    v_src = k_src if V_LIKE_K else token[:, None] * stride_vt + v_inner[None, :]
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + k_src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + v_src, mask=mask), mask=mask)


@dual_jit(do_not_specialize=("num_tokens",))
def _store_quantized_kernel(
    x_ptr,
    cache_ptr,
    scale_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_xt,
    stride_xh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    LIMIT: tl.constexpr,
    ROUND: tl.constexpr,
    CODED: tl.constexpr,
    CODE_BIAS: tl.constexpr,
    CODE_SHIFT: tl.constexpr,
    MAX_CODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
):
    # One tensor (K or V) a launch; program (token tile, KV head). Same arithmetic as quantize_ref:
    # scale = max|x| / LIMIT rounded to the scale dtype (CODED: up, to a one-byte code, in integer
    # operations on its float32 bits), x / scale clamped, rounded half up (int8). Both divisions
    # round to nearest as torch's do (div_rn; a plain `/` is approximate on a GPU, and one ulp
    # can move a code up a step or a value across a rounding boundary).
    token = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    head = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_P)
    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
    live = slot >= 0
    mask = live[:, None]
    if HEAD_DIM != HEAD_DIM_P:
        mask = mask & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + (token * stride_xt + head * stride_xh)[:, None] + d[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    exact = tl.math.div_rn(tl.reduce(tl.abs(x), 1, tl.standard._elementwise_max), LIMIT)
    if CODED:
        up = (exact.to(tl.int32, bitcast=True) + ((1 << CODE_SHIFT) - 1)) >> CODE_SHIFT
        code = tl.minimum(tl.maximum(up - CODE_BIAS, 0), MAX_CODE)
        divisor = ((code + CODE_BIAS) << CODE_SHIFT).to(tl.float32, bitcast=True)
        scale = code.to(tl.uint8)
    else:
        scale = exact.to(scale_ptr.dtype.element_ty)
        divisor = scale.to(tl.float32)
        divisor = tl.where(divisor > 0, divisor, 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, divisor[:, None]), -LIMIT), LIMIT)
    if ROUND:
        y = tl.floor(y + 0.5)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = (block * stride_cb + offset * stride_cs + head * stride_ch)[:, None] + d[None, :]
    tl.store(cache_ptr + dst, y.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + block * stride_sb + offset * stride_ss + head * stride_sh, scale, mask=live)


@dual_jit(do_not_specialize=("num_pairs",))
def _copy_blocks_kernel(
    k_cache_ptr,
    v_cache_ptr,
    src_ptr,
    dst_ptr,
    num_pairs,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    TOKEN_LEN: tl.constexpr,
    BLOCK_LEN: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    elem = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
    live = pair < num_pairs
    src = tl.load(src_ptr + pair, mask=live, other=0).to(tl.int64) * stride_cb
    dst = tl.load(dst_ptr + pair, mask=live, other=0).to(tl.int64) * stride_cb
    inner = elem // TOKEN_LEN * stride_cs + elem % TOKEN_LEN // HEAD_DIM * stride_ch + elem % HEAD_DIM
    mask = live[:, None] & (elem < BLOCK_LEN)[None, :]
    k = tl.load(k_cache_ptr + src[:, None] + inner[None, :], mask=mask)
    v = tl.load(v_cache_ptr + src[:, None] + inner[None, :], mask=mask)
    tl.store(k_cache_ptr + dst[:, None] + inner[None, :], k, mask=mask)
    tl.store(v_cache_ptr + dst[:, None] + inner[None, :], v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write token t's K/V ([T, Hkv, D] each) into slot slot_mapping[t] = block * block_size + offset of
    k_cache/v_cache ([num_blocks, block_size, Hkv, D]); a slot of -1 skips the token.

    With `k_scale` and `v_scale` ([num_blocks, block_size, Hkv]) the caches are int8 or
    float8_e4m3fn and each token's head is quantized as it is written, its scale stored at the same
    slot (`radixkv.kernels.reference.quantize_ref` is the arithmetic); k and v are then in any float
    dtype. Otherwise k and v have the cache's dtype and are copied as they are.
    """
    check_cache(k_cache, v_cache, k_scale, v_scale)
    check_kernel_device("k_cache", k_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    quantized = k_scale is not None
    for name, t in (("k", k), ("v", v)):
        dtype_ok = t.is_floating_point() if quantized else t.dtype == k_cache.dtype
        if t.dim() != 3 or t.shape[1:] != k_cache.shape[2:] or not dtype_ok or t.stride(2) != 1:
            want = "a float dtype" if quantized else f"k_cache's dtype {k_cache.dtype}"
            raise ValueError(
                f"{name} must be [T, Hkv, D] = [*, {num_kv_heads}, {head_dim}] with {want} "
                f"and a contiguous last dimension, got {tuple(t.shape)}, {t.dtype}"
            )
        check_same_device(name, t, k_cache.device)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(
            f"v must have k's shape {tuple(k.shape)} and dtype {k.dtype}, got {tuple(v.shape)}, {v.dtype}"
        )
    num_tokens = k.shape[0]
    check_index("slot_mapping", slot_mapping, (num_tokens,), k_cache.device)
    if num_tokens == 0:
        return
    if quantized:
        _store_quantized(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return
    row_len = num_kv_heads * head_dim
    device = k_cache.device
    plan = plan_copy(num_tokens, row_len, interpreted(device))
    with launch_guard():
        _store_kv_kernel.on(device)[(triton.cdiv(num_tokens, plan.rows), triton.cdiv(row_len, plan.cols))](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            num_tokens,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            HEAD_DIM=head_dim,
            ROW_LEN=row_len,
            BLOCK_SIZE=block_size,
            ROWS=plan.rows,
            COLS=plan.cols,
            V_LIKE_K=k.stride()[:2] == v.stride()[:2],
            HEADS_PACKED=k.stride(1) == v.stride(1) == k_cache.stride(2) == head_dim,
            SLOTS_PACKED=k_cache.stride(0) == block_size * k_cache.stride(1),
        )


def _store_quantized(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens = k.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    head_dim_p = padded_head_dim(head_dim)
    device = k_cache.device
    rows = plan_copy(num_tokens, head_dim_p, interpreted(device)).rows
    grid = (triton.cdiv(num_tokens, rows), num_kv_heads)
    with launch_guard():
        for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            _store_quantized_kernel.on(device)[grid](
                x,
                cache,
                scale,
                slot_mapping,
                num_tokens,
                x.stride(0),
                x.stride(1),
                cache.stride(0),
                cache.stride(1),
                cache.stride(2),
                scale.stride(0),
                scale.stride(1),
                scale.stride(2),
                LIMIT=QUANTIZED_DTYPES[cache.dtype],
                ROUND=cache.dtype == torch.int8,
                CODED=scale.dtype == scale_code.SCALE_CODE_DTYPE,
                CODE_BIAS=scale_code.CODE_BIAS,
                CODE_SHIFT=scale_code.SHIFT,
                MAX_CODE=scale_code.MAX_CODE,
                HEAD_DIM=head_dim,
                HEAD_DIM_P=head_dim_p,
                BLOCK_SIZE=block_size,
                ROWS=rows,
            )


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: Sequence[int] | torch.Tensor,
    dst: Sequence[int] | torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Copy whole blocks src[i] -> dst[i] in both caches (copy-on-write of a shared block), and in
    `k_scale`, `v_scale` when given (a quantized cache's, as store_kv takes them).

    The caches' elements are moved, not read as numbers: any dtype of 1, 2 or 4 bytes.
    Pairs run in parallel, so no dst block may be a src block of the same call, nor repeat.
    """
    check_cache(k_cache, v_cache, any_dtype=True)
    if (k_scale is None) != (v_scale is None):
        raise ValueError("copy_blocks takes both k_scale and v_scale or neither")
    check_kernel_device("k_cache", k_cache)
    src = _block_ids("src", src, -1, k_cache.device)
    dst = _block_ids("dst", dst, src.shape[0], k_cache.device)
    if k_scale is not None:
        check_cache(k_cache, v_cache, k_scale, v_scale)
        copy_blocks(k_scale[..., None], v_scale[..., None], src, dst)
    num_pairs = src.shape[0]
    if num_pairs == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_len = block_size * num_kv_heads * head_dim
    device = k_cache.device
    plan = plan_copy(num_pairs, block_len, interpreted(device))
    with launch_guard():
        grid = (triton.cdiv(num_pairs, plan.rows), triton.cdiv(block_len, plan.cols))
        _copy_blocks_kernel.on(device)[grid](
            k_cache,
            v_cache,
            src,
            dst,
            num_pairs,
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            HEAD_DIM=head_dim,
            TOKEN_LEN=num_kv_heads * head_dim,
            BLOCK_LEN=block_len,
            ROWS=plan.rows,
            COLS=plan.cols,
        )


def _block_ids(
    name: str, ids: Sequence[int] | torch.Tensor, length: int, device: torch.device
) -> torch.Tensor:
    """A 1-D int tensor of block ids on `device` (lists are copied there); `length` -1: any."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.tensor(ids, dtype=torch.int64, device=device)
    check_index(name, ids, (length,), device)
    return ids
