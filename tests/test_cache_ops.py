"""store_kv and copy_blocks against the plain-torch reference: exact, and nothing else touched."""

import pytest
import torch

from radixkv.kernels import cache_ops, copy_blocks, store_kv
from radixkv.kernels.launch_plan import INTERPRETED, CopyPlan
from radixkv.kernels.reference import copy_blocks_ref, store_kv_ref

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_caches(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    return k_cache, v_cache


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "slot_dtype"),
    [
        (torch.float32, 16, 64, torch.int64),
        (torch.float16, 1, 80, torch.int32),
        (torch.bfloat16, 128, 96, torch.int64),
    ],
)
def test_store_kv_writes_each_slot_and_skips_minus_one(
    dtype: torch.dtype, block_size: int, head_dim: int, slot_dtype: torch.dtype
) -> None:
    num_tokens, num_blocks = 50, 100 // block_size + 1
    k_cache, v_cache = make_caches(num_blocks, block_size, 2, head_dim, dtype)
    generator = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(DEVICE)
    slots[::7] = -1
    k, v = torch.randn(2, num_tokens, 2, head_dim, generator=generator).to(DEVICE, dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    store_kv(k, v, k_cache, v_cache, slots.to(slot_dtype))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_store_kv_reads_strided_k_and_v() -> None:
    """k and v as views into one fused projection output, as a model produces them."""
    k_cache, v_cache = make_caches(4, 8, 4, 32, torch.float32)
    fused = torch.randn(10, 3 * 4 * 32, device=DEVICE)
    k = fused[:, 128:256].view(10, 4, 32)
    v = fused[:, 256:].view(10, 4, 32)
    slots = torch.arange(3, 13, dtype=torch.int32, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_store_kv_takes_any_row_layout() -> None:
    """k with its heads apart (a head-major buffer), v with strides of its own, caches whose blocks
    are padded apart (a view): none of the layouts the kernel simplifies for."""
    padded = torch.zeros(2, 4, 8 + 2, 3, 16, device=DEVICE)
    k_cache, v_cache = padded[0, :, :8], padded[1, :, :8]
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(3, 10, 16, generator=generator).to(DEVICE).transpose(0, 1)
    v = torch.randn(10, 3, 16, generator=generator).to(DEVICE)
    slots = torch.randperm(32, generator=generator)[:10].to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_whole_blocks_and_nothing_else(dtype: torch.dtype) -> None:
    k_cache, v_cache = make_caches(10, 16, 2, 80, dtype)
    src, dst = [0, 3, 3, 7], [1, 4, 9, 2]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    copy_blocks_ref(expected_k, expected_v, src, dst)
    copy_blocks(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_copy_blocks_takes_int32_tensors() -> None:
    k_cache, v_cache = make_caches(6, 128, 1, 64, torch.float32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    copy_blocks_ref(expected_k, expected_v, [5], [0])
    src, dst = torch.tensor([[5], [0]], dtype=torch.int32, device=DEVICE)
    copy_blocks(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_empty_calls_change_nothing() -> None:
    k_cache, v_cache = make_caches(2, 4, 1, 32, torch.float32)
    before = k_cache.clone()
    copy_blocks(k_cache, v_cache, [], [])
    no_slots = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    store_kv(k_cache[0, :0], v_cache[0, :0], k_cache, v_cache, no_slots)
    assert torch.equal(k_cache, before)


def test_wrong_store_kv_arguments_raise_value_error_naming_them() -> None:
    k_cache, v_cache = make_caches(2, 4, 2, 32, torch.float32)
    k = torch.randn(3, 2, 32, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="k must be"):
        store_kv(torch.randn(3, 3, 32, device=DEVICE), k, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="v must be"):
        store_kv(k, k.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="v_cache"):
        store_kv(k, k, k_cache, v_cache.half(), slots)


def test_wrong_copy_blocks_arguments_raise_value_error_naming_them() -> None:
    k_cache, v_cache = make_caches(4, 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="dst"):
        copy_blocks(k_cache, v_cache, [0, 1], [2])
    with pytest.raises(ValueError, match="src"):
        copy_blocks(k_cache, v_cache, torch.tensor([0.0], device=DEVICE), [2])
    with pytest.raises(ValueError, match="k_cache"):
        copy_blocks(k_cache[0], v_cache[0], [0], [1])


def test_small_tiles_cover_every_row_and_column(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles smaller than the work in both directions, as on a GPU: partial tiles stay masked."""
    monkeypatch.setattr(cache_ops, "plan_copy", lambda rows, row_len, interpreted: CopyPlan(rows=4, cols=32))
    k_cache, v_cache = make_caches(8, 4, 3, 40, torch.float16)
    generator = torch.Generator().manual_seed(2)
    slots = torch.randperm(32, generator=generator)[:9].to(DEVICE)
    k, v = torch.randn(2, 9, 3, 40, generator=generator).to(DEVICE, torch.float16)
    assert_store_then_copy_match_reference(k_cache, v_cache, k, v, slots)


def assert_store_then_copy_match_reference(k_cache, v_cache, k, v, slots) -> None:
    """store_kv of `k`, `v` at `slots`, then a copy of blocks 1, 2, 5 to 0, 6, 7 (needs 8 blocks),
    leave the caches exactly as the plain-torch references do."""
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    copy_blocks_ref(expected_k, expected_v, [1, 2, 5], [0, 6, 7])
    store_kv(k, v, k_cache, v_cache, slots)
    copy_blocks(k_cache, v_cache, [1, 2, 5], [0, 6, 7])
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
