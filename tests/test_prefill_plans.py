"""The GPU's prefill and extend plans (`radixkv.kernels.launch_plan.PREFILL_TILES`) against the
plain-torch reference, run through the Triton interpreter at small shapes.

Each tile of the table (and the fallback) is planned as `plan_attention_gpu` plans it for its
device and head size, then launched explicitly (`launch_attention`) over a ragged batch of
prefills, extends and decodes. Warps and stages are the compiler's and the interpreter ignores
them; what it checks is the tile's shape: rows, keys a step, one item a program, the GPU's tile
count bound. A poisoned-future check proves that no key past an item's last query row is read.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from test_paged_attention import DEVICE, assert_matches_reference, make_batch

from radixkv.kernels import launch_plan, paged_attention
from radixkv.kernels.launch_plan import (
    FALLBACK_PREFILL_TILE,
    PREFILL_TILES,
    max_tiles,
    plan_attention_gpu,
    prefill_tile,
)
from radixkv.kernels.paged_attention import launch_attention, plan_paged_attention
from radixkv.kernels.reference import paged_attention_ref

ATTENTION = importlib.import_module("radixkv.kernels.paged_attention")  # the package's name is the function
# Ragged: a long prefill over several tiles of 128 rows, extends, decodes, odd lengths.
LENS = [(70, 0), (1, 37), (19, 5), (33, 90), (1, 0), (2, 1)]
CASES = [(major, head) for major, by_head in PREFILL_TILES.items() for head in by_head] + [(7, 128)]


def gpu_plan(
    monkeypatch, major: int, num_tokens: int, num_seqs: int, group: int, head: int, num_kv_heads: int = 2
):
    """`plan_attention_gpu`'s plan on a device of compute capability `major`.x with 132 SMs."""
    monkeypatch.setattr(launch_plan, "_capability", lambda device: (major, 0))
    monkeypatch.setattr(launch_plan, "_sm_count", lambda device: 132)
    return plan_attention_gpu(torch.device("cuda"), num_tokens, num_seqs, num_kv_heads, group, head, 4096, 2)


@pytest.mark.parametrize(("major", "head"), CASES, ids=[f"sm{m}x-head{h}" for m, h in CASES])
def test_every_gpu_prefill_tile_matches_reference(monkeypatch, major, head):
    """One KV head of 4 query heads: every program the interpreter runs costs the same whatever
    its tile, and the tile's shape is the subject here (KV heads beyond the first are checked on
    the same kernel in test_paged_attention)."""
    batch = make_batch(LENS, num_heads=4, num_kv_heads=1, head_dim=head, block_size=16, seed=major)
    num_tokens, num_seqs = batch.q.shape[0], batch.seq_lens.shape[0]
    plan = gpu_plan(monkeypatch, major, num_tokens, num_seqs, 4, head, num_kv_heads=1)
    tile = PREFILL_TILES.get(major, {}).get(head, FALLBACK_PREFILL_TILE)
    shape = (plan.block_q * 4, plan.block_n, plan.num_warps, plan.items)
    assert shape == (tile.rows, tile.block_n, tile.num_warps, 1)
    out = torch.empty_like(batch.q)
    launch_attention(plan, None, max_tiles(num_tokens, num_seqs, plan.block_q), *batch, head**-0.5, out)
    assert_matches_reference(out, batch)


@pytest.mark.parametrize("major", [9, 8, 7])
def test_no_key_past_an_items_last_query_row_is_read(monkeypatch, major):
    """One prefill of two tiles: V holds NaN from the first tile's end on. The first tile's rows
    must stay finite (they read no key of the second tile, even in the masked part of the
    diagonal block) and match the reference; the second tile's rows read the NaN, as they must."""
    plan = gpu_plan(monkeypatch, major, 256, 1, 4, 64)
    rows = plan.block_q
    batch = make_batch([(2 * rows, 0)], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    clean = batch.v_cache.clone()
    v = batch.v_cache.view(-1, 2, 64)
    slots = (batch.block_table[0].long()[:, None] * 16 + torch.arange(16, device=DEVICE)).flatten()
    v[slots[rows : 2 * rows]] = float("nan")
    out = torch.empty_like(batch.q)
    launch_attention(plan, None, 2, *batch, 64**-0.5, out)
    expected = paged_attention_ref(*batch._replace(v_cache=clean))
    assert torch.isfinite(out[:rows]).all()
    torch.testing.assert_close(out[:rows], expected[:rows], atol=2e-5, rtol=2e-5)
    assert torch.isnan(out[rows:]).all()


def test_gpu_mixed_batch_plans_decodes_and_prefills_apart(monkeypatch):
    """A mixed batch on a GPU gets the decode plan over its one-token sequences and the prefill
    tile over the rest; run here through the interpreter, both launches together match."""
    batch = make_batch(LENS, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    monkeypatch.setattr(launch_plan, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(launch_plan, "_sm_count", lambda device: 132)
    monkeypatch.setattr(ATTENTION, "interpreted", lambda device: False)
    launches = plan_paged_attention(
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        num_tokens=batch.q.shape[0],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        itemsize=4,
    )
    monkeypatch.undo()
    (decode, _, _), (prefill, _, _) = launches.launches
    assert decode.block_q * 4 == 16 and prefill.block_q * 4 == PREFILL_TILES[9][64].rows
    out = paged_attention(*batch, launches=launches)
    assert_matches_reference(out, batch)


def test_stages_shrink_to_fit_shared_memory():
    hopper = prefill_tile((9, 0), 128, itemsize=2)
    assert hopper == PREFILL_TILES[9][128]  # bf16: Q and 3 stages of K and V fit in 227 KiB
    ampere_fp32 = prefill_tile((8, 6), 256, itemsize=4)
    tile = PREFILL_TILES[8][256]
    assert ampere_fp32.num_stages < tile.num_stages
    used = (tile.rows + ampere_fp32.num_stages * 2 * tile.block_n) * 256 * 4
    assert used <= launch_plan.SHARED_MEMORY_BYTES[8] or ampere_fp32.num_stages == 1
    assert prefill_tile((9, 0), 96) == prefill_tile((9, 0), 128)  # padded to the next head size
    assert prefill_tile((7, 5), 64, itemsize=2) == FALLBACK_PREFILL_TILE  # a Turing: the fallback
