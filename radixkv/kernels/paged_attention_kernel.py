"""The two Triton kernels of paged attention (their host side, plans and launches, is
radixkv.kernels.paged_attention, whose docstring states the algorithm): `paged_attention_kernel`
walks one item batch's keys with the online softmax, `merge_splits_kernel` merges split-KV
ranges by their log-sum-exp. Both are `dual_jit`: compiled on a GPU, interpreted per launch on
the CPU (radixkv.kernels.dispatch)."""

import triton.language as tl

from radixkv.kernels.dispatch import dual_jit


@dual_jit(do_not_specialize=("num_items", "kv_per_split", "stride_bt", "window"))
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    lse_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    qk_scale,
    cap_in,
    cap_out,
    window,
    num_items,
    kv_per_split,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ITEMS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FLAT_LOADS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    OUT_LIKE_Q: tl.constexpr,
    QUANTIZED: tl.constexpr,
    CODED: tl.constexpr,
    CODE_BIAS: tl.constexpr,
    CODE_SHIFT: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_Q * GROUP_P
    # int64 indices throughout: the interpreter checks every int32 add and mul for overflow (7 extra
    # numpy ops each), and cache offsets can pass 2**31 anyway.
    item = tl.program_id(0).to(tl.int64) * ITEMS + tl.arange(0, ITEMS)
    in_grid = item < num_items
    tile = item // NUM_KV_HEADS
    kv_head = item % NUM_KV_HEADS
    seq = tl.load(tile_seq_ptr + tile, mask=in_grid, other=0)
    q_first = tl.load(tile_start_ptr + tile, mask=in_grid, other=0)
    q_end = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64)
    live = in_grid & (q_first < q_end)
    shift = tl.load(seq_lens_ptr + seq) - q_end  # position of new token t (index into q) is t + shift
    kv_end = tl.where(live, tl.minimum(q_first + BLOCK_Q, q_end) + shift, 0)
    last_key = tl.maximum(kv_end - 1, 0)
    kv_max = tl.reduce(kv_end, 0, tl.standard._elementwise_max)
    first_pos = tl.where(live, q_first + shift + 1, kv_max)
    unmasked_end = tl.minimum(tl.reduce(first_pos, 0, tl.standard._elementwise_min), kv_max)
    kv_lo = tl.program_id(1).to(tl.int64) * kv_per_split
    if WINDOW:
        # An item's first query (position first_pos - 1) sees keys from first_pos - window on; keys
        # below every item's first key are never read, so blocks wholly outside the window are
        # skipped (their table entries may be anything). Below window_end some row needs the mask.
        first_key = tl.maximum(first_pos - window, 0)
        window_end = tl.reduce(tl.where(live, kv_end - window, 0), 0, tl.standard._elementwise_max)
        lowest = tl.reduce(first_key, 0, tl.standard._elementwise_min)
        kv_lo = tl.maximum(kv_lo, lowest // BLOCK_N * BLOCK_N)
    else:
        window_end = 0

    r = tl.arange(0, ROWS)
    t = q_first[:, None] + (r // GROUP_P)[None, :]
    group_head = r % GROUP_P
    head = kv_head[:, None] * GROUP + group_head[None, :]
    # Compile-time branches drop the padding masks where there is no padding (in the interpreter
    # every op costs the same whatever its size, and each dropped op is one less).
    row_ok = live[:, None] & (t < q_end[:, None])
    if GROUP != GROUP_P:
        row_ok = row_ok & (group_head < GROUP)[None, :]
    pos_q = t + shift[:, None]
    d = tl.arange(0, HEAD_DIM_P)
    io_mask = row_ok[:, :, None]
    if HEAD_DIM != HEAD_DIM_P:
        io_mask = io_mask & (d < HEAD_DIM)[None, None, :]
    q_rows = (t * stride_qt + head * stride_qh)[:, :, None] + d[None, None, :]
    q = (tl.load(q_ptr + q_rows, mask=io_mask, other=0.0).to(tl.float32) * qk_scale).to(DOT_DTYPE)
    # Padded head-size lanes re-read the last real lane: q is 0 there, so scores are unchanged, and
    # the output lanes are never stored. The K/V gathers then need no mask at all. Unpadded lanes stay
    # `d` itself, which Triton knows to be contiguous: the gathers compile to 16-byte vector loads
    # (through the clamp they were element by element, a tenth of a GPU's bandwidth).
    if HEAD_DIM == HEAD_DIM_P:  # noqa: SIM108 (a compile-time branch, as measured on the GPU)
        d_kv = d
    else:
        d_kv = tl.minimum(d, HEAD_DIM - 1)
    k_lanes = (k_cache_ptr + d_kv)[None, None, :]
    v_lanes = (v_cache_ptr + d_kv)[None, None, :]
    table_row = block_table_ptr + seq * stride_bt
    head_offset = kv_head * stride_ch

    m_i = tl.full([ITEMS, ROWS], -1.0e30, tl.float32)
    l_i = tl.full([ITEMS, ROWS], 0.0, tl.float32)
    acc = tl.full([ITEMS, ROWS, HEAD_DIM_P], 0.0, tl.float32)
    kv_hi = tl.minimum(tl.program_id(1).to(tl.int64) * kv_per_split + kv_per_split, kv_max)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        # Keys past an item's end re-read its last key, keys before its window its first key (stored
        # slots both); the mask drops them.
        key = tl.minimum(n[None, :], last_key[:, None])
        if WINDOW:
            key = tl.maximum(key, first_key[:, None])
        block = tl.load(table_row[:, None] + key // BLOCK_SIZE, mask=live[:, None], other=0)
        rows = block.to(tl.int64) * stride_cb + (key % BLOCK_SIZE) * stride_cs + head_offset[:, None]
        k_ptrs = k_lanes + rows[:, :, None]
        v_ptrs = v_lanes + rows[:, :, None]
        if FLAT_LOADS:
            k_ptrs = tl.reshape(k_ptrs, [ITEMS * BLOCK_N * HEAD_DIM_P])
            v_ptrs = tl.reshape(v_ptrs, [ITEMS * BLOCK_N * HEAD_DIM_P])
        k = tl.reshape(tl.load(k_ptrs), [ITEMS, BLOCK_N, HEAD_DIM_P]).to(DOT_DTYPE)
        v = tl.reshape(tl.load(v_ptrs), [ITEMS, BLOCK_N, HEAD_DIM_P]).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k, 0, 2, 1), input_precision=DOT_PRECISION)
        if QUANTIZED:  # a key's scales, [ITEMS, BLOCK_N]: K's scales each score, V's its probability
            scale_rows = block.to(tl.int64) * stride_sb + (key % BLOCK_SIZE) * stride_ss
            scale_rows += (kv_head * stride_sh)[:, None]
            k_scale = tl.load(k_scale_ptr + scale_rows)
            v_scale = tl.load(v_scale_ptr + scale_rows)
            if CODED:  # one-byte codes (radixkv.kernels.scale_code): the float32 bits, shifted in
                k_scale = (k_scale.to(tl.int32) + CODE_BIAS) << CODE_SHIFT
                v_scale = (v_scale.to(tl.int32) + CODE_BIAS) << CODE_SHIFT
                k_scale, v_scale = k_scale.to(tl.float32, bitcast=True), v_scale.to(tl.float32, bitcast=True)
            s = s * k_scale.to(tl.float32)[:, None, :]
            v_scale = v_scale.to(tl.float32)[:, None, :]
        if SOFTCAP:
            # q carries the plain scale here: s is the logit, capped as cap * tanh(s / cap) with
            # tanh(x) = 1 - 2 / (exp(2x) + 1) (exact at both ends) and taken to base 2: cap_in is
            # 2 * log2(e) / cap, cap_out cap * log2(e).
            s = cap_out * (1.0 - 2.0 / (tl.exp2(s * cap_in) + 1.0))
        if (start + BLOCK_N > unmasked_end) | (start < window_end):
            visible = n[None, None, :] <= pos_q[:, :, None]
            if WINDOW:
                visible = visible & (n[None, None, :] > pos_q[:, :, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 2, tl.standard._elementwise_max))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, :, None])
        l_i = l_i * alpha + tl.reduce(p, 2, tl.standard._sum_combine)
        if QUANTIZED:
            p = p * v_scale
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, :, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # l_i is 0 only where no key was seen: rows that are not stored, or a split with no keys.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    # Output rows with q's strides (the usual out, split or not) take q's offsets.
    out_rows = q_rows if OUT_LIKE_Q else (t * stride_ot + head * stride_oh)[:, :, None] + d[None, None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + out_rows, (acc / l_safe[:, :, None]).to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        split = tl.program_id(1)
        tl.store(out_ptr + split * stride_os + out_rows, acc / l_safe[:, :, None], mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + t * stride_lt + head, lse, mask=row_ok)


@dual_jit()
def merge_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_heads,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ls,
    stride_lt,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = row // num_heads
    h = row % num_heads
    split = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_P)
    lse = tl.load(lse_ptr + split * stride_ls + t * stride_lt + h)
    weight = tl.exp2(lse - tl.reduce(lse, 0, tl.standard._elementwise_max))
    part = tl.load(
        part_ptr + (split * stride_ps + t * stride_pt + h * stride_ph)[:, None] + d[None, :],
        mask=(d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.reduce(weight, 0, tl.standard._sum_combine)
    out = tl.reduce(part * weight[:, None], 0, tl.standard._sum_combine) / total
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
