"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed.

A decode step of a small model is hundreds of small kernel launches; on a GPU their launch cost
rivals the work. A graph records the whole forward once and replays it with one launch. A graph
replays fixed addresses and shapes, so each bucket (1, 2, 4, 8, then multiples of 16 up to
`max_num_seqs`) reads its inputs from static buffers that a step fills: its sequences in the
first rows, the padding rows after them with slot -1 (store_kv writes nothing) and length 1 (their
attention reads one valid slot; their logits are dropped). The attention launches are planned
inside the capture (the GPU plan needs no host sync) from the block table's width, so a graph's
width fixes how many ranges its decode splits each sequence's keys into. One width as wide as
`max_model_len` allows would give every step the most splits, which short contexts pay for in
programs with nothing to read and a combining pass. So each bucket is captured at the widths where
the plan changes (`context_widths`, `graph_routes`), and a step replays the narrowest graph that
covers its block table. With KV groups (`radixkv.cache.kv_groups`) every group has its own slot
and block-table buffers beside group 0's, filled and padded alike.

Guarded: graphs only on CUDA, only for steps where every sequence has one new token and gets
logits, and a capture that fails (a model that syncs during its forward) warns once and leaves
the runner eager for good. Nothing here runs on a CPU: these paths are checked by `pytest -m gpu`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from radixkv.cache.kv_groups import KVGroups
from radixkv.kernels.launch_plan import GPU_MAX_SPLITS, GPU_MIN_KEYS_PER_SPLIT, plan_attention_gpu
from radixkv.model.attention_backend import PagedBatch
from radixkv.model.loader import LoadedModel
from radixkv.model.persistent_batch import HostBatch


class GraphedRunner(Protocol):
    """What the graphs read of the runner they capture for (`radixkv.model.runner.ModelRunner`,
    which builds them, so this module cannot import it): its model and shapes, and the
    attention inputs it plans for a step."""

    loaded: LoadedModel
    groups: KVGroups
    model: torch.nn.Module
    device: torch.device
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def paged_batch(self, step: HostBatch) -> PagedBatch: ...


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 16, and `max_num_seqs` itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += [b for b in range(16, max_num_seqs, 16)]
    return [*sizes, max_num_seqs]


def context_widths(max_width: int, block_size: int) -> list[int]:
    """Block-table widths (blocks) a bucket may be captured at, ascending, the widest last: just
    under each key capacity at which the GPU plan may double its splits (2 x 512 x 2^k keys), up
    to the most splits, then `max_width`."""
    widths = []
    splits = 1
    while splits < GPU_MAX_SPLITS:
        width = (2 * splits * GPU_MIN_KEYS_PER_SPLIT - 1) // block_size
        if width >= max_width:
            break
        if width > 0:
            widths.append(width)
        splits *= 2
    return [*widths, max_width]


def graph_routes(
    buckets: list[int], widths: list[int], plan_of: Callable[[int, int], object]
) -> dict[tuple[int, int], tuple[int, int]]:
    """For every (bucket, width), the (bucket, width) of the graph that runs it: the widest width
    of that bucket with the same plan (`plan_of(bucket, width)`), so that a graph is captured only
    where the plan differs. A narrower width's graph serves any table up to its width."""
    routes = {}
    for bucket in buckets:
        widest = widths[-1]
        for width in reversed(widths):
            if plan_of(bucket, width) != plan_of(bucket, widest):
                widest = width
            routes[(bucket, width)] = (bucket, widest)
    return routes


class DecodeGraphs:
    """Captured decode forwards of one runner, by bucket, all captured at start (`capture_all`)."""

    def __init__(self, runner: GraphedRunner, max_num_seqs: int) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_num_seqs)
        device = runner.device
        width = -(-runner.loaded.max_model_len // runner.block_size)
        self.widths = context_widths(width, runner.block_size)
        self.routes = graph_routes(self.buckets, self.widths, self._plan)
        ints = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros((1, max_num_seqs), **ints)
        self.position_ids = torch.zeros((1, max_num_seqs), **ints)
        self.slot_mapping = torch.full((max_num_seqs,), -1, **ints)
        self.seq_lens = torch.ones((max_num_seqs,), **ints)
        self.query_start_loc = torch.arange(max_num_seqs + 1, **ints)  # one token per sequence, always
        self.logit_rows = torch.arange(max_num_seqs, **ints)
        self.block_table = torch.zeros((max_num_seqs, width), **ints)
        others = runner.groups.num_groups - 1  # KV groups 1..: their own slots and tables
        self.group_slots = torch.full((others, max_num_seqs), -1, **ints)
        self.group_tables = torch.zeros((others, max_num_seqs, width), **ints)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: object | None = None
        self.failed = False

    def fits(self, step: HostBatch) -> bool:
        """A decode step the graphs can run: one new token and one logits row per sequence."""
        num_seqs = step.seq_lens.shape[0]
        return (
            not self.failed
            and step.input_ids.shape[1] == num_seqs == step.logit_rows.shape[0]
            and num_seqs <= self.buckets[-1]
            and step.block_table.shape[1] <= self.block_table.shape[1]
        )

    def run(self, step: HostBatch) -> torch.Tensor:
        """Float32 logits `[S, vocab]` of the step (one that `fits`) by graph replay."""
        num_seqs, width = step.block_table.shape
        bucket = next(b for b in self.buckets if b >= num_seqs)
        covering = next(w for w in self.widths if w >= width)
        self.input_ids[:, :num_seqs].copy_(step.input_ids)
        self.position_ids[:, :num_seqs].copy_(step.position_ids)
        self.slot_mapping[:num_seqs].copy_(step.slot_mapping)
        self.slot_mapping[num_seqs:bucket].fill_(-1)
        self.seq_lens[:num_seqs].copy_(step.seq_lens)
        self.seq_lens[num_seqs:bucket].fill_(1)
        self.block_table[:num_seqs, :width].copy_(step.block_table)
        for g, (slots, table) in enumerate(zip(step.group_slots, step.group_tables, strict=True)):
            self.group_slots[g, :num_seqs].copy_(slots)
            self.group_slots[g, num_seqs:bucket].fill_(-1)
            self.group_tables[g, :num_seqs, :width].copy_(table)
        graph, logits = self._graphs[self.routes[(bucket, covering)]]
        graph.replay()
        return logits[:num_seqs].clone()  # the graph overwrites its output at the next replay

    def _plan(self, size: int, width: int) -> object:
        """The attention plan a decode of `size` sequences over a table `width` blocks wide gets."""
        runner = self.runner
        return plan_attention_gpu(
            runner.device,
            size,
            size,
            runner.num_kv_heads,
            runner.num_heads // runner.num_kv_heads,
            runner.head_dim,
            width * runner.block_size,
        )

    def _forward(self, size: int, width: int) -> torch.Tensor:
        batch = HostBatch(
            input_ids=self.input_ids[:, :size],
            position_ids=self.position_ids[:, :size],
            logit_rows=self.logit_rows[:size],
            slot_mapping=self.slot_mapping[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            block_table=self.block_table[:size, :width],
            group_slots=tuple(slots[:size] for slots in self.group_slots),
            group_tables=tuple(table[:size, :width] for table in self.group_tables),
        )
        paged: PagedBatch = self.runner.paged_batch(batch)
        output = self.runner.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            logits_to_keep=batch.logit_rows,
            paged_batch=paged,
        )
        return output.logits[0].float()

    def capture_all(self) -> None:
        """Captures every bucket, largest first (the smaller ones reuse its pool's memory), as vLLM
        does at start: a first decode of each size would otherwise stall every request in flight for
        the capture and for Triton's compile of its launch plan. The buffers hold padding rows
        meanwhile (slot -1, length 1, block 0), so the forwards store nothing. A failed capture
        leaves the runner eager (`failed`)."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_table.zero_()
        self.group_slots.fill_(-1)
        self.group_tables.zero_()
        for size, width in sorted(set(self.routes.values()), reverse=True):
            if not self._capture(size, width):
                return

    def _capture(self, size: int, width: int) -> bool:
        """Warm up on a side stream (Triton compiles there), then capture into the shared pool."""
        try:
            side = torch.cuda.Stream(self.runner.device)
            side.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(side):
                self._forward(size, width)
            torch.cuda.current_stream(self.runner.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(size, width)
        except RuntimeError as error:
            where = f"batch {size}, {width} blocks wide"
            message = f"CUDA graph capture failed ({where}); decoding eagerly: {error}"
            warnings.warn(message, stacklevel=2)
            self.failed = True
            self._graphs.clear()  # never replayed now: give their memory back
            self._pool = None
            return False
        self._pool = graph.pool()
        self._graphs[(size, width)] = (graph, logits)
        return True
