import pytest
import torch

from radixkv.cache.block_pool import BlockPool, OutOfBlocks, num_blocks_for_budget, parse_bytes
from radixkv.model.runner import kv_block_bytes


def test_allocate_and_free_round_trip():
    pool = BlockPool(4, 16)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free == 1
    assert all(pool.refcount(b) == 1 for b in blocks)
    pool.incref(blocks[0])
    assert not pool.decref(blocks[0])
    assert all(pool.decref(b) for b in blocks)
    assert pool.num_free == 4


def test_running_out_raises_out_of_blocks_and_allocates_nothing():
    pool = BlockPool(2, 8)
    pool.allocate(1)
    with pytest.raises(OutOfBlocks) as e:
        pool.allocate(2)
    assert (e.value.needed, e.value.free) == (2, 1)
    assert pool.num_free == 1


def test_freeing_a_free_block_raises():
    pool = BlockPool(2, 8)
    (b,) = pool.allocate(1)
    pool.decref(b)
    with pytest.raises(ValueError, match="already free"):
        pool.decref(b)
    with pytest.raises(ValueError, match="is free"):
        pool.incref(b)


@pytest.mark.parametrize("bad", [0, 3, 256, -1, 2.0])
def test_block_size_must_be_a_power_of_two_up_to_128(bad):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, bad)


def test_pool_is_sized_by_the_standard_formula():
    per_block = kv_block_bytes(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    assert per_block == 2 * 4 * 16 * 2 * 64 * 2
    assert num_blocks_for_budget("1MiB", per_block) == (1 << 20) // per_block
    assert num_blocks_for_budget(per_block * 10 + 5, per_block) == 10


@pytest.mark.parametrize(
    ("text", "value"),
    [("512MiB", 512 << 20), ("2 GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("4096", 4096), (77, 77)],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-5MiB", 0])
def test_parse_bytes_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes(bad)


def test_budget_too_small_for_one_block_is_refused():
    with pytest.raises(ValueError, match="holds no KV block"):
        num_blocks_for_budget("1KiB", 4096)
