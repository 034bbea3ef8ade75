"""The int8 KV cache in the kernels, against the plain-torch reference of the same quantization.

store_kv must store exactly `quantize_ref`'s bytes and scales; paged_attention over a quantized
cache must give what `paged_attention_ref` gives over the values those bytes and scales stand for,
on every plan shape, with windows and logit caps, with scales in float16, float32 and the engine's
one-byte codes. Slots no sequence covers hold NaN scales, so that a read outside a sequence shows
even where its weight is 0; no code decodes to NaN, so under codes those slots hold the largest
value at the largest code (127 x 3,840), which shows wherever a stray read has any weight.
"""

import pytest
import torch
from test_paged_attention import (
    MIXED,
    PLAN_IDS,
    PLAN_SHAPES,
    TOLERANCE,
    Batch,
    make_batch,
    poison_outside_window,
)

from radixkv.kernels import copy_blocks, paged_attention, store_kv
from radixkv.kernels.checks import QUANTIZED_DTYPES
from radixkv.kernels.launch_plan import INTERPRETED, AttentionPlan, max_tiles
from radixkv.kernels.paged_attention import launch_attention
from radixkv.kernels.reference import copy_blocks_ref, paged_attention_ref, quantize_ref, store_kv_ref
from radixkv.kernels.scale_code import MAX_CODE, SCALE_CODE_DTYPE

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


class Quantized:
    """A batch with its caches quantized by the reference: (batch, k_scale, v_scale)."""

    def __init__(self, batch: Batch, dtype: torch.dtype = torch.int8, scale_dtype=SCALE_CODE_DTYPE) -> None:
        caches, scales = [], []
        for cache in (batch.k_cache, batch.v_cache):
            values, scale = quantize_ref(torch.nan_to_num(cache), dtype, scale_dtype)
            outside = torch.isnan(cache).any(-1)
            if scale_dtype == SCALE_CODE_DTYPE:
                largest = torch.tensor(QUANTIZED_DTYPES[dtype]).to(dtype)
                values = values.masked_fill(outside[..., None], largest)
                scale = scale.masked_fill(outside, MAX_CODE)
            else:
                scale = scale.masked_fill(outside, float("nan"))
            scales.append(scale)
            caches.append(values)
        self.batch = batch._replace(k_cache=caches[0], v_cache=caches[1])
        self.k_scale, self.v_scale = scales

    def reference(self, **kwargs) -> torch.Tensor:
        return paged_attention_ref(*self.batch, k_scale=self.k_scale, v_scale=self.v_scale, **kwargs)


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("x_dtype", "scale_dtype", "block_size", "head_dim"),
    [
        (torch.float32, torch.float16, 16, 64),
        (torch.bfloat16, torch.float32, 1, 80),
        (torch.float16, torch.float16, 8, 48),
        (torch.float32, SCALE_CODE_DTYPE, 16, 32),
        (torch.bfloat16, SCALE_CODE_DTYPE, 8, 48),
    ],
)
def test_store_kv_stores_the_reference_quantization_and_skips_minus_one(
    x_dtype: torch.dtype, scale_dtype: torch.dtype, block_size: int, head_dim: int
) -> None:
    num_tokens, num_blocks, num_kv_heads = 40, 64 // block_size + 1, 2
    generator = torch.Generator().manual_seed(1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randint(-127, 128, (2, *shape), generator=generator, dtype=torch.int8).to(DEVICE)
    k_scale, v_scale = (torch.rand(2, *shape[:3], generator=generator) * 100).to(DEVICE, scale_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(DEVICE)
    slots[::7] = -1
    k, v = (torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=generator) * 3).to(DEVICE, x_dtype)
    k[3] = 0.0  # an all-zero head: scale 0 (code 0), values 0
    if scale_dtype == SCALE_CODE_DTYPE:  # a large scale, and one past the largest code (3,840)
        k[5, 0] *= 1e4
        v[6, 1] = 1e6
    expected = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    store_kv_ref(k, v, *expected[:2], slots, *expected[2:])
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    for got, want in zip((k_cache, v_cache, k_scale, v_scale), expected, strict=True):
        assert torch.equal(got, want)
    assert k_scale.view(-1, num_kv_heads)[slots[3]].eq(0).all()


def test_quantization_error_is_small_but_not_zero() -> None:
    """The oracle sees the quantization: int8 attention is near full precision, and not equal to it."""
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    error = (Quantized(batch).reference() - paged_attention_ref(*batch)).abs().max().item()
    assert 1e-4 < error < 0.05


@pytest.mark.parametrize(
    ("block_size", "gqa", "head_dim", "dtype", "scale_dtype"),
    [
        (16, 4, 64, torch.float32, torch.float16),
        (8, 3, 48, torch.float16, torch.float32),
        (1, 1, 32, torch.bfloat16, torch.float16),
        (16, 2, 32, torch.float32, SCALE_CODE_DTYPE),
        (4, 3, 80, torch.bfloat16, SCALE_CODE_DTYPE),
    ],
)
def test_mixed_ragged_batch_over_int8_cache_matches_reference(
    block_size: int, gqa: int, head_dim: int, dtype: torch.dtype, scale_dtype: torch.dtype
) -> None:
    sizes = {"num_heads": 2 * gqa, "num_kv_heads": 2, "head_dim": head_dim, "block_size": block_size}
    quant = Quantized(make_batch(MIXED, **sizes, dtype=dtype), scale_dtype=scale_dtype)
    out = paged_attention(*quant.batch, k_scale=quant.k_scale, v_scale=quant.v_scale)
    assert out.dtype == dtype
    assert_close(out, quant.reference())


@pytest.mark.parametrize("scale_dtype", [torch.float16, SCALE_CODE_DTYPE], ids=["float16", "codes"])
@pytest.mark.parametrize(
    "plan",
    PLAN_SHAPES,
    ids=PLAN_IDS,
)
def test_every_plan_shape_over_int8_cache_matches_reference(plan: AttentionPlan, scale_dtype) -> None:
    """Decode, prefill and extend in each plan, with a window (blocks outside it poisoned) and a cap."""
    batch = make_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8)
    batch = poison_outside_window(batch, 24)
    quant = Quantized(batch, scale_dtype=scale_dtype)
    out = torch.empty_like(batch.q)
    num_tiles = max_tiles(batch.q.shape[0], batch.seq_lens.shape[0], plan.block_q)
    launch_attention(
        plan,
        None,
        num_tiles,
        *quant.batch,
        1 / 32**0.5,
        out,
        24,
        3.0,
        k_scale=quant.k_scale,
        v_scale=quant.v_scale,
    )
    assert_close(out, quant.reference(window=24, softcap=3.0))


def test_store_then_attend_matches_reference_of_the_stored_cache() -> None:
    """The engine's order: new tokens quantized by store_kv, then attended over with the cached ones."""
    quant = Quantized(make_batch([(5, 20), (1, 9)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8))
    batch = quant.batch
    generator = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, 6, 2, 32, generator=generator).to(DEVICE)
    table = batch.block_table.long() * 8
    slots = torch.cat(
        [
            table[0].repeat_interleave(8)[20:25] + torch.arange(20, 25) % 8,
            table[1].repeat_interleave(8)[9:10] + 1,
        ]
    )
    store_kv(k, v, batch.k_cache, batch.v_cache, slots, quant.k_scale, quant.v_scale)
    out = paged_attention(*batch, k_scale=quant.k_scale, v_scale=quant.v_scale)
    assert_close(out, quant.reference())


def test_copy_blocks_moves_scales_with_their_blocks() -> None:
    quant = Quantized(make_batch([(3, 40)], num_kv_heads=2, head_dim=32, block_size=8))
    caches = [quant.batch.k_cache, quant.batch.v_cache, quant.k_scale, quant.v_scale]
    expected = [t.clone() for t in caches]
    copy_blocks_ref(*expected[:2], [0, 2], [5, 7])
    copy_blocks_ref(*expected[2:], [0, 2], [5, 7])
    copy_blocks(*caches[:2], [0, 2], [5, 7], *caches[2:])
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_wrong_quantized_arguments_raise_value_error_naming_them() -> None:
    quant = Quantized(make_batch(MIXED[:3]))
    batch, k_scale, v_scale = quant.batch, quant.k_scale, quant.v_scale
    float_batch = make_batch(MIXED[:3])
    cases = [
        ("k_scale and v_scale go with", dict(k_scale=k_scale, v_scale=v_scale), float_batch),
        ("needs both", dict(k_scale=k_scale), batch),
        ("k_cache dtype", {}, batch),
        ("k_scale must be", dict(k_scale=k_scale[:, :2], v_scale=v_scale[:, :2]), batch),
        ("v_scale must have", dict(k_scale=k_scale, v_scale=v_scale.float()), batch),
    ]
    for message, scales, b in cases:
        with pytest.raises(ValueError, match=message):
            paged_attention(*b, **scales)
    k = torch.randn(2, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="k must be"):
        store_kv(
            k.to(torch.int32),
            k,
            batch.k_cache,
            batch.v_cache,
            torch.arange(2, device=DEVICE),
            k_scale,
            v_scale,
        )


@pytest.mark.skipif(
    INTERPRETED or torch.cuda.get_device_capability() < (8, 9),
    reason="float8_e4m3fn needs a CUDA device of compute capability 8.9 or later (the interpreter's "
    "float8 conversion does not round as the hardware does)",
)
def test_fp8_store_and_attention_match_reference_on_gpu() -> None:
    quant = Quantized(make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64), torch.float8_e4m3fn)
    out = paged_attention(*quant.batch, k_scale=quant.k_scale, v_scale=quant.v_scale)
    assert_close(out, quant.reference())
    k, v = torch.randn(2, 9, 2, 64, device=DEVICE)
    slots = torch.arange(9, device=DEVICE)
    caches = [quant.batch.k_cache, quant.batch.v_cache, quant.k_scale, quant.v_scale]
    expected = [t.clone() for t in caches]
    store_kv_ref(k, v, *expected[:2], slots, *expected[2:])
    store_kv(k, v, *caches[:2], slots, *caches[2:])
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.float().nan_to_num(), want.float().nan_to_num())
