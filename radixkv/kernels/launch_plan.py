"""Tile and grid choice for the kernels, by device.

Two machines with opposite costs:

- The Triton interpreter (no GPU) runs every tl op as a numpy op over the whole tile. Measured on
  the 2-core development machine: about 0.1-0.2 ms per op per program whatever the tile size, about
  10 ns per element gathered by tl.load (a C++ loop over pointers: 8 ns through 1-D pointer tensors
  against 14 ns through 3-D ones) and about 1 ns per element for each elementwise pass. So the
  interpreter plan uses few programs and tiles as large as Triton allows (2**20 elements): one
  program covers many sequences and all query heads of a KV head, and gathers through 1-D pointers.
- A GPU wants enough programs to fill its SMs and tiles that fit registers: one item per program,
  16 query rows for a decode and split-KV (several programs per item, each on a range of keys,
  merged by a second kernel) when a decode batch is too small to fill the SMs; for prefill and
  extend the tile of `PREFILL_TILES`, by compute capability and head size.
"""

import functools
from dataclasses import dataclass

import torch

from radixkv.kernels.dispatch import FORCE_INTERPRET

INTERPRETED: bool = FORCE_INTERPRET or not torch.cuda.is_available()
"""Whether kernels on this machine's default device (CUDA when present, else the CPU) run in the
interpreter; tests and benchmarks pick their device from it. Each launch decides from its own
tensors (`radixkv.kernels.dispatch.interpreted`)."""
MAX_TILE = 1 << 20
"""Elements in the largest tile of an interpreter program (Triton's limit on a tensor)."""
INTERPRETER_ROWS = 2048
"""Query rows (tokens x heads) per interpreter program: 2048 rows x 512 keys fill MAX_TILE, which
measured best for a 2 x 2048 prefill (fewer key steps than 512 rows x 2048 keys, less causal waste
than 4096 x 256)."""
INTERPRETER_MIN_BLOCK_N = 64
"""Fewest keys per interpreter step: below it the per-op cost of a step outweighs its work."""
GPU_MAX_SPLITS = 16
GPU_MIN_KEYS_PER_SPLIT = 512
"""Split-KV for a GPU decode: up to 16 ranges of 512 keys or more, merged by a second kernel."""


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one paged-attention launch cuts its work.

    An item is `block_q` consecutive new tokens of one sequence times the query heads of one KV head.
    A program handles `items` items side by side and walks their keys `block_n` at a time, in
    `num_splits` independent ranges. `flat_loads` gathers through 1-D pointer tensors (interpreter).
    `num_warps` and `num_stages` are the compiler's (Triton's defaults; the interpreter ignores them).
    """

    block_q: int
    items: int
    block_n: int
    num_splits: int
    flat_loads: bool
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class PrefillTile:
    """A GPU prefill/extend tile: `rows` query rows (new tokens x the query heads of one KV head)
    by `block_n` keys a step, compiled with `num_warps` warps and `num_stages` stages of K/V tiles
    in flight (Triton pipelines the key loop's block-table gathers into shared memory)."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int


PREFILL_TILES: dict[int, dict[int, PrefillTile]] = {
    # compute capability major -> padded head size (at most) -> tile. The accumulator is
    # rows x head fp32 spread over the warps' threads: 128 x 128 over 8 warps is 64 registers a
    # thread, as FlashAttention-2 sizes it; a head of 256 halves the rows. Hopper and Ampere keep
    # 3 stages of 64-key K and V tiles (plus the Q tile) within their shared memory.
    9: {
        64: PrefillTile(128, 64, 4, 3),
        128: PrefillTile(128, 64, 8, 3),
        256: PrefillTile(64, 32, 8, 2),
    },
    8: {
        64: PrefillTile(128, 64, 4, 3),
        128: PrefillTile(64, 64, 4, 3),
        256: PrefillTile(64, 32, 8, 2),
    },
}
FALLBACK_PREFILL_TILE = PrefillTile(32, 64, 4, 2)
"""Older or unknown devices, and heads over 256 (the first plan measured: a 2 x 2,048 prefill in 1.8 ms
on an H200 with 32 rows, against 40 ms at 64 rows on 4 warps, before stages and warps were tuned)."""
SHARED_MEMORY_BYTES = {9: 227 * 1024, 8: 99 * 1024}
"""Shared memory a program may use: Hopper's 227 KiB; for sm 8.x the 99 KiB of sm86/sm89 (the
A100's sm80 has 163 KiB: the smaller bound holds on both)."""


def prefill_tile(capability: tuple[int, int], head_dim: int, itemsize: int = 4) -> PrefillTile:
    """The prefill/extend tile for a device of compute `capability` and a head size: the table's
    entry for the smallest padded head size that holds it, with fewer stages (down to 1) where
    Q plus the stages of K and V, of `itemsize`-byte elements, would pass the shared memory (an
    estimate: the compiler's scratch comes on top)."""
    head = padded_head_dim(head_dim)
    by_head = PREFILL_TILES.get(capability[0], {})
    fitting = [h for h in sorted(by_head) if h >= head]
    tile = by_head[fitting[0]] if fitting else FALLBACK_PREFILL_TILE
    limit = SHARED_MEMORY_BYTES.get(capability[0], 48 * 1024)
    stages = tile.num_stages
    while stages > 1 and (tile.rows + stages * 2 * tile.block_n) * head * itemsize > limit:
        stages -= 1
    return PrefillTile(tile.rows, tile.block_n, tile.num_warps, stages)


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """How a store/copy launch cuts its work: `rows` rows of `cols` elements per program."""

    rows: int
    cols: int


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1). triton.next_power_of_2 does the same, but as a
    constexpr function it costs about 20 us a call on the host, several per launch."""
    return 1 << (n - 1).bit_length()


def padded_group(group: int) -> int:
    """Query heads per KV head, padded to a power of two (a tile dimension)."""
    return next_power_of_2(group)


def padded_head_dim(head_dim: int) -> int:
    """Head size padded to a power of two, and to 16 at least (tl.dot's smallest K on a GPU)."""
    return max(16, next_power_of_2(head_dim))


def plan_attention_interpreted(
    num_items: int, max_q_len: int, max_kv_len: int, group: int, head_dim: int
) -> AttentionPlan:
    """Interpreter plan for at least `num_items` items whose lengths are known on the host.

    Rows per item: the longest new-token run (1 for decode) times the padded group, up to
    INTERPRETER_ROWS; then as many items as fill INTERPRETER_ROWS, and keys per step up to MAX_TILE
    elements in the score and K/V tiles.
    """
    group_p = padded_group(group)
    block_q = min(next_power_of_2(max_q_len), max(1, INTERPRETER_ROWS // group_p))
    rows = block_q * group_p
    width = max(rows, padded_head_dim(head_dim))
    items = min(
        next_power_of_2(num_items),
        max(1, INTERPRETER_ROWS // rows),
        max(1, MAX_TILE // (width * INTERPRETER_MIN_BLOCK_N)),
    )
    block_n = min(MAX_TILE // (items * width), next_power_of_2(max_kv_len))
    return AttentionPlan(block_q, items, block_n, num_splits=1, flat_loads=True)


def plan_attention_gpu(
    device: torch.device,
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_kv_len: int,
    itemsize: int = 4,
) -> AttentionPlan:
    """GPU plan from host-known sizes only (no device sync); `max_kv_len` is the block table's capacity,
    `itemsize` the bytes of a K/V element (default float32's, the most shared memory).

    Rows per item: 16 (tl.dot's smallest M) when every sequence has one new token, else the
    `prefill_tile` of the device and head size (rows, keys a step, warps, stages), its rows no
    more than the longest run of new tokens needs. Each item's key loop ends at its last query
    row's position (the kernel's `kv_end`), so no key block wholly above the diagonal is read. A batch
    with fewer items than SMs splits each item's keys into up to 16 ranges of 512 keys or more.
    An unsplit decode runs 2 warps a program: more programs resident per SM keep more K/V loads in
    flight. Measured on an H200 (bf16, 32 query / 8 KV heads of 128, 64 keys a step): decodes of
    64 x 4,096 and 256 x 1,024 tokens read at 0.86 of peak bandwidth with 2 warps against 0.53 with
    4; split decodes measured best with 4 (0.38 of peak at 8 x 4,096, where one wave barely fills
    the GPU). A 2 x 2,048 prefill took 1.8 ms at 32 rows against 40 ms at 64 and 50 ms at 128 (the
    accumulator no longer fits the registers), and 7.1 ms in the torch reference.
    """
    group_p = padded_group(group)
    decode = num_tokens == num_seqs
    if decode:
        block_q, block_n, stages = max(1, 16 // group_p), 64 if padded_head_dim(head_dim) <= 128 else 32, 3
    else:
        tile = prefill_tile(_capability(device), head_dim, itemsize)
        block_q, block_n, stages = max(1, tile.rows // group_p), tile.block_n, tile.num_stages
    items = max_tiles(num_tokens, num_seqs, block_q) * num_kv_heads
    num_splits = 1
    while (
        num_splits < GPU_MAX_SPLITS
        and items * num_splits < _sm_count(device)
        and max_kv_len >= 2 * num_splits * GPU_MIN_KEYS_PER_SPLIT
    ):
        num_splits *= 2
    num_warps = (2 if num_splits == 1 else 4) if decode else tile.num_warps
    return AttentionPlan(
        block_q, 1, block_n, num_splits, flat_loads=False, num_warps=num_warps, num_stages=stages
    )


def max_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Most tiles of `block_q` new tokens that `num_tokens` tokens in `num_seqs` sequences can need."""
    return min(num_tokens, (num_tokens + num_seqs * (block_q - 1)) // block_q)


def plan_copy(num_rows: int, row_len: int, interpreted: bool) -> CopyPlan:
    """Rows of `row_len` elements (tokens for store_kv, blocks for copy_blocks) to move.

    Interpreter: up to MAX_TILE // 4 elements per program (the load loop is fastest below 2**18
    elements), as few rows as the launch needs. GPU: 4096-element tiles of a fixed shape for a row
    length, whatever `num_rows`: each shape is a compile (about a second), which a first step of a
    new size would otherwise wait for, and a masked row costs a GPU nothing.
    """
    budget = MAX_TILE // 4 if interpreted else 4096
    cols = min(next_power_of_2(row_len), budget)
    rows = max(1, budget // cols)
    if interpreted:
        rows = min(next_power_of_2(num_rows), rows)
    return CopyPlan(rows, cols)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)
