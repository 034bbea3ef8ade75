"""Plain-torch references of the kernels, the oracle of the tests and the baseline of the benchmark.

Same contracts as `paged_attention`, `store_kv` and `copy_blocks` of radixkv.kernels, written for
clarity first but without waste: attention gathers each sequence's KV through its block table and
runs torch's scaled_dot_product_attention on it, computing in float32. A quantized cache (int8 or
float8_e4m3fn with per-token, per-head scales: float16, float32, or one-byte codes) is dequantized
whole first: the kernels must give
what attention over exactly those stored values gives.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from radixkv.kernels.checks import QUANTIZED_DTYPES
from radixkv.kernels.scale_code import SCALE_CODE_DTYPE, decode_scale, encode_scale


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per sequence: gather K/V through the block table, expand the KV heads to the query heads
    (measured faster on CPU than SDPA's enable_gqa), then SDPA with the causal mask aligned to the
    end of the sequence (is_causal when there is no cached prefix, no mask for a single token).

    With a `window` only the keys some new token sees are gathered (from the first new token's
    position - window + 1 on) and the mask keeps key j for the token at p where p - window < j <= p.
    With a `softcap` the logits are written out: softmax(softcap * tanh(q k^T * scale / softcap)).
    With `k_scale` and `v_scale` the caches are quantized: attention runs over `dequantize_ref` of them.
    """
    if k_scale is not None:
        k_cache, v_cache = dequantize_ref(k_cache, k_scale), dequantize_ref(v_cache, v_scale)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for s, (seq_len, q_lo, q_hi) in enumerate(
        zip(seq_lens.tolist(), query_start_loc[:-1].tolist(), query_start_loc[1:].tolist(), strict=True)
    ):
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        lo = 0 if window is None else max(0, seq_len - q_len - window + 1)
        blocks = block_table[s, lo // block_size : (seq_len + block_size - 1) // block_size].long()
        skip = lo - lo // block_size * block_size
        k = k_cache[blocks].flatten(0, 1)[skip : seq_len - lo + skip]
        v = v_cache[blocks].flatten(0, 1)[skip : seq_len - lo + skip]
        k = k.transpose(0, 1).float().repeat_interleave(group, 0)
        v = v.transpose(0, 1).float().repeat_interleave(group, 0)
        qs = q[q_lo:q_hi].transpose(0, 1).float()
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        keys = torch.arange(lo, seq_len, device=q.device)[None, :]
        mask = keys <= positions
        if window is not None:
            mask &= keys > positions - window
        if softcap is not None:
            logits = softcap * torch.tanh(qs @ k.transpose(1, 2) * scale / softcap)
            o = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1) @ v
        elif q_len == 1 and window is None:
            o = F.scaled_dot_product_attention(qs, k, v, scale=scale)
        elif q_len == seq_len and window is None:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[q_lo:q_hi] = o.transpose(0, 1).to(q.dtype)
    return out


def quantize_ref(
    x: torch.Tensor, dtype: torch.dtype, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., D]` as `dtype` (int8 or float8_e4m3fn) and one scale per row `[...]`: the scale is
    max|row| / the dtype's largest value, rounded to `scale_dtype` (to nearest for float16 and
    float32, 0 for an all-zero row, which then divides by 1; up to a one-byte code for uint8, see
    radixkv.kernels.scale_code); each element is x / scale, clamped to that largest value, then
    rounded half up for int8 or cast for float8. Computed in float32."""
    limit = QUANTIZED_DTYPES[dtype]
    x = x.float()
    exact = x.abs().amax(-1) / limit
    if scale_dtype == SCALE_CODE_DTYPE:
        scale = encode_scale(exact)
        divisor = decode_scale(scale)
    else:
        scale = exact.to(scale_dtype)
        divisor = torch.where(scale > 0, scale.float(), 1.0)
    y = (x / divisor[..., None]).clamp(-limit, limit)
    return (torch.floor(y + 0.5) if dtype == torch.int8 else y).to(dtype), scale


def dequantize_ref(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values a quantized cache `[..., D]` with its scales `[...]` stands for."""
    scale = decode_scale(scale) if scale.dtype == SCALE_CODE_DTYPE else scale.float()
    return cache.float() * scale[..., None]


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache.view(-1, Hkv, D)[slot] = k[t] for every token whose slot is not -1; likewise v. With
    scales, each token's head is stored as `quantize_ref` of it and its scale at the same slot."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if scale is None:
            cache[blocks, offsets] = x[keep]
        else:
            cache[blocks, offsets], scale[blocks, offsets] = quantize_ref(x[keep], cache.dtype, scale.dtype)


def copy_blocks_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: Sequence[int] | torch.Tensor,
    dst: Sequence[int] | torch.Tensor,
) -> None:
    """k_cache[dst[i]] = k_cache[src[i]] and likewise for v_cache."""
    src = torch.as_tensor(src, dtype=torch.long, device=k_cache.device)
    dst = torch.as_tensor(dst, dtype=torch.long, device=k_cache.device)
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]
