"""paged_attention against the plain-torch reference (radixkv.kernels.reference); on a machine without a GPU
the kernels run in the Triton interpreter.

Every listed value of each axis (block size, GQA ratio, head size, dtype) appears at least once, each
time on a mixed ragged batch. Plan shapes the automatic choice does not reach on this device (several
tiles and key steps per sequence, the GPU's one item per program and split-KV) run through
launch_attention.
"""

import functools
import os
import subprocess
import threading
from typing import NamedTuple

import pytest
import torch

from radixkv.interpreter import python_argv
from radixkv.kernels import launch_plan, paged_attention
from radixkv.kernels.launch_plan import INTERPRETED, AttentionPlan, max_tiles
from radixkv.kernels.paged_attention import launch_attention
from radixkv.kernels.reference import paged_attention_ref

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (new tokens, cached tokens) per sequence: decode, single-token sequence (no cache), prefill, extend,
# lengths that are not multiples of any block size.
MIXED = [(1, 37), (1, 0), (19, 0), (5, 60), (1, 130), (33, 17), (2, 1), (1, 255)]

# One plan of each shape the launcher picks: several items a program, items spanning sequences,
# and the GPU's one item a program, with and without split KV.
PLAN_SHAPES = [
    AttentionPlan(block_q=4, items=4, block_n=16, num_splits=1, flat_loads=True),
    AttentionPlan(block_q=8, items=2, block_n=32, num_splits=1, flat_loads=False),
    AttentionPlan(block_q=4, items=1, block_n=16, num_splits=1, flat_loads=False),
    AttentionPlan(block_q=16, items=1, block_n=32, num_splits=4, flat_loads=False),
]
PLAN_IDS = ["several-items", "items-span-sequences", "gpu-one-item", "gpu-split-kv"]


class Batch(NamedTuple):
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def make_batch(
    lens: list[tuple[int, int]],
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Sequences on shuffled physical blocks; every slot no sequence covers holds NaN, and block-table
    entries past a sequence's blocks hold -1, so a read outside the sequence would show."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [new + cached for new, cached in lens]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    physical = torch.randperm(num_blocks, generator=generator)
    block_table = torch.full((len(lens), max(blocks)), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for s, (n, count) in enumerate(zip(seq_lens, blocks, strict=True)):
        block_table[s, :count] = physical[used : used + count]
        used += count
        slots = (block_table[s, :count, None].long() * block_size + torch.arange(block_size)).flatten()[:n]
        for cache in (k_cache, v_cache):
            values = torch.randn(n, num_kv_heads, head_dim, generator=generator)
            cache.view(-1, num_kv_heads, head_dim)[slots] = values.to(dtype)
    new_tokens = torch.tensor([new for new, _ in lens])
    q = torch.randn(int(new_tokens.sum()), num_heads, head_dim, generator=generator).to(dtype)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), new_tokens.cumsum(0)]).to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return Batch(*(t.to(DEVICE) for t in (q, k_cache, v_cache, block_table, seq_lens_t, query_start_loc)))


def assert_matches_reference(out: torch.Tensor, batch: Batch, scale: float | None = None) -> None:
    expected = paged_attention_ref(*batch, scale=scale)
    tol = TOLERANCE[batch.q.dtype]
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("block_size", "gqa", "head_dim", "dtype"),
    [
        (1, 1, 64, torch.float32),
        (8, 4, 80, torch.float16),
        (16, 8, 128, torch.bfloat16),
        (32, 4, 96, torch.float32),
        (128, 1, 80, torch.bfloat16),
        (16, 8, 64, torch.float16),
        (8, 3, 48, torch.float32),  # a group and a head size that need padding
    ],
)
def test_mixed_ragged_batch_matches_reference(
    block_size: int, gqa: int, head_dim: int, dtype: torch.dtype
) -> None:
    sizes = {"num_heads": 2 * gqa, "num_kv_heads": 2, "head_dim": head_dim, "block_size": block_size}
    batch = make_batch(MIXED, **sizes, dtype=dtype)
    assert_matches_reference(paged_attention(*batch), batch)


def test_many_sequences_of_different_lengths_in_one_call() -> None:
    generator = torch.Generator().manual_seed(1)
    new = torch.randint(1, 40, (40,), generator=generator)
    new[::3] = 1
    new[7] = 0
    cached = torch.randint(0, 300, (40,), generator=generator)
    cached[::5] = 0
    batch = make_batch(list(zip(new.tolist(), cached.tolist(), strict=True)), num_heads=4, num_kv_heads=1)
    assert_matches_reference(paged_attention(*batch), batch)


def test_decode_batch_with_long_contexts_matches_reference() -> None:
    batch = make_batch([(1, n) for n in (2000, 1500, 999, 1, 64, 1200)], num_heads=8, num_kv_heads=2)
    assert_matches_reference(paged_attention(*batch), batch)


def test_prefill_and_extend_longer_than_one_key_step_match_reference() -> None:
    batch = make_batch([(700, 0), (300, 900)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=32)
    assert_matches_reference(paged_attention(*batch), batch)


@pytest.mark.parametrize(
    "plan",
    PLAN_SHAPES,
    ids=PLAN_IDS,
)
def test_every_plan_shape_matches_reference(plan: AttentionPlan) -> None:
    """With the GPU's tile count (a bound from the shapes): the tiles past the last do nothing."""
    batch = make_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=80, block_size=8)
    out = torch.empty_like(batch.q)
    num_tiles = max_tiles(batch.q.shape[0], batch.seq_lens.shape[0], plan.block_q)
    launch_attention(plan, None, num_tiles, *batch, 1 / 80**0.5, out)
    assert_matches_reference(out, batch)


def test_calls_from_several_threads_at_once_match_reference() -> None:
    """The interpreter patches triton.language module-wide during a launch; the kernels serialize."""
    batch = make_batch(MIXED[:4], num_heads=4, head_dim=32)
    outs: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: outs.append(paged_attention(*batch))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outs) == 4
    for out in outs:
        assert_matches_reference(out, batch)


@pytest.mark.parametrize("like_q", [True, False])
def test_writes_into_out_and_applies_scale(like_q: bool) -> None:
    batch = make_batch(MIXED[:4], dtype=torch.float16)
    t, h, d = batch.q.shape
    # out with q's strides, or a view whose rows have strides of their own
    out = torch.empty_like(batch.q) if like_q else torch.empty(t, h, d + 8, dtype=torch.float16)[:, :, :d]
    assert paged_attention(*batch, scale=0.3, out=out) is out
    assert_matches_reference(out, batch, scale=0.3)


def test_empty_batch_returns_empty() -> None:
    batch = make_batch([(1, 3)])
    empty = batch._replace(
        q=batch.q[:0],
        block_table=batch.block_table[:0],
        seq_lens=batch.seq_lens[:0],
        query_start_loc=batch.query_start_loc[:1],
    )
    out = paged_attention(*empty)
    assert out.shape == (0, 8, 64)


# id: (how the batch goes wrong, the argument the error must name)
BAD_ARGUMENTS = {
    "q-head-size": (lambda b: b._replace(q=b.q[:, :, :32]), "q"),
    "q-dtype": (lambda b: b._replace(q=b.q.half()), "q"),
    "q-device": (lambda b: b._replace(q=b.q.to("meta")), "q"),
    "head-count": (lambda b: b._replace(q=b.q[:, :7]), "head count"),
    "k_cache-shape": (lambda b: b._replace(k_cache=b.k_cache[0]), "k_cache"),
    "v_cache-shape": (lambda b: b._replace(v_cache=b.v_cache[:, :8]), "v_cache"),
    "block_table-dtype": (lambda b: b._replace(block_table=b.block_table.float()), "block_table"),
    "seq_lens-length": (lambda b: b._replace(seq_lens=b.seq_lens[:-1]), "seq_lens"),
    "query_start_loc-length": (lambda b: b._replace(query_start_loc=b.seq_lens), "query_start_loc"),
}


@pytest.mark.parametrize("wrong", BAD_ARGUMENTS)
def test_wrong_argument_raises_value_error_naming_it(wrong: str) -> None:
    spoil, name = BAD_ARGUMENTS[wrong]
    with pytest.raises(ValueError, match=name):
        paged_attention(*spoil(make_batch(MIXED[:3])))


def test_wrong_out_raises_value_error_naming_it() -> None:
    batch = make_batch(MIXED[:3])
    with pytest.raises(ValueError, match="out"):
        paged_attention(*batch, out=torch.empty(batch.q.shape[0], 8, 32, device=DEVICE))


def test_gpu_plan_splits_small_decode_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_plan, "_sm_count", lambda device: 132)
    monkeypatch.setattr(launch_plan, "_capability", lambda device: (9, 0))
    sizes = {"num_kv_heads": 2, "group": 4, "head_dim": 128, "max_kv_len": 32768}
    decode = launch_plan.plan_attention_gpu(torch.device("cuda"), 4, 4, **sizes)
    prefill = launch_plan.plan_attention_gpu(torch.device("cuda"), 8192, 4, **sizes)
    assert decode.num_splits > 1 and decode.block_q * 4 == 16 and decode.items == 1
    assert decode.num_splits & (decode.num_splits - 1) == 0
    assert prefill.num_splits == 1 and prefill.block_q * 4 == launch_plan.PREFILL_TILES[9][128].rows
    # A GPU copy plan is one shape per row length (one compile), whatever the number of rows.
    gpu_copy = functools.partial(launch_plan.plan_copy, row_len=256, interpreted=False)
    assert gpu_copy(1) == gpu_copy(300)


def poison_outside_window(batch: Batch, window: int) -> Batch:
    """Point every block-table entry wholly before all of its sequence's windows at a block of NaN,
    so a kernel that reads a block it should skip shows NaN in its output."""
    block_size = batch.k_cache.shape[1]
    table = batch.block_table.clone()
    poison = int(torch.isnan(batch.k_cache.flatten(1)).all(1).nonzero()[0])  # a block no sequence uses
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    for s, (seq_len, q_len) in enumerate(zip(batch.seq_lens.tolist(), q_lens, strict=True)):
        first_key = max(0, seq_len - q_len - window + 1)
        table[s, : first_key // block_size] = poison
    return batch._replace(block_table=table)


@pytest.mark.parametrize(
    ("window", "softcap", "block_size", "dtype"),
    [
        (8, None, 8, torch.float32),
        (1, None, 4, torch.float32),
        (40, 5.0, 8, torch.float16),
        (None, 2.0, 16, torch.float32),
        (20, 1.0, 1, torch.bfloat16),
    ],
)
def test_sliding_window_and_softcap_match_reference(
    window: int | None, softcap: float | None, block_size: int, dtype: torch.dtype
) -> None:
    """Decode, prefill and extend in one call; blocks outside every window hold NaN and are skipped."""
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size, dtype=dtype)
    if window is not None:
        batch = poison_outside_window(batch, window)
    out = paged_attention(*batch, window=window, softcap=softcap)
    expected = paged_attention_ref(*batch, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_window_and_softcap_change_the_result_and_a_wide_window_does_not() -> None:
    """The oracle itself is not blind to either: a window no sequence reaches is plain causal."""
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    plain = paged_attention(*batch)
    torch.testing.assert_close(paged_attention(*batch, window=256), plain, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(paged_attention(*batch, window=16), plain, atol=1e-3)
    assert not torch.allclose(paged_attention(*batch, softcap=1.0), plain, atol=1e-3)


@pytest.mark.parametrize(
    "plan",
    [
        AttentionPlan(block_q=4, items=4, block_n=16, num_splits=1, flat_loads=True),
        AttentionPlan(block_q=4, items=1, block_n=16, num_splits=1, flat_loads=False),
        AttentionPlan(block_q=16, items=1, block_n=32, num_splits=4, flat_loads=False),
    ],
    ids=["several-items", "gpu-one-item", "gpu-split-kv"],
)
def test_every_plan_shape_with_window_and_softcap_matches_reference(plan: AttentionPlan) -> None:
    batch = make_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8)
    batch = poison_outside_window(batch, 24)
    out = torch.empty_like(batch.q)
    num_tiles = max_tiles(batch.q.shape[0], batch.seq_lens.shape[0], plan.block_q)
    launch_attention(plan, None, num_tiles, *batch, 1 / 32**0.5, out, 24, 3.0)
    torch.testing.assert_close(out, paged_attention_ref(*batch, window=24, softcap=3.0), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("argument", "value"), [("window", 0), ("softcap", 0.0), ("softcap", -1.0)])
def test_bad_window_or_softcap_raises_value_error_naming_it(argument: str, value: float) -> None:
    with pytest.raises(ValueError, match=argument):
        paged_attention(*make_batch(MIXED[:3]), **{argument: value})


@pytest.mark.skipif(not INTERPRETED, reason="the import order matters for the interpreter only")
def test_works_when_triton_was_imported_before_kernels() -> None:
    """transformers imports triton (through torch._inductor) before the engine imports kernels, so
    triton.language's own jit functions are then compiled-mode only; the kernels must not need them."""
    script = (
        "import triton, torch\n"
        "from radixkv import kernels\n"
        "from radixkv.kernels.reference import paged_attention_ref\n"
        "q, k = torch.randn(3, 4, 32), torch.randn(2, 4, 2, 32)\n"
        "args = (q, k, k, torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),\n"
        "        torch.tensor([0, 3], dtype=torch.int32))\n"
        "torch.testing.assert_close(kernels.paged_attention(*args), paged_attention_ref(*args))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(python_argv("-c", script), env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
