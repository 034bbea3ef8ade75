"""A step's host-tier loads, written into the device cache layer by layer as the forward reaches
each layer (SGLang HiCache's layer-wise loading).

`ModelRunner.load` does not copy into the device cache at once. It reads the host blocks now,
into a staging tensor laid out layer-major (`[layers, 2, blocks, ...]`, pinned on CUDA), and
queues the write of the device blocks here; the forward pass then runs the queue, and the
attention of layer l calls `wait(l)` before it reads or writes layer l of the cache. So layer 0
computes as soon as its blocks are in, while the later layers' blocks are still moving.

- On a CPU, `wait(l)` writes layer l's blocks right there, synchronously.
- On CUDA, `start()` issues every layer's copies on a side stream (host-to-device from the
  pinned staging, then a scatter into the cache), recording one event per layer, and `wait(l)`
  makes the compute stream wait on event l. The side stream first waits on the compute stream,
  so the copies come after everything queued before them there: the step's copy-on-write copies
  and offloads, and the earlier steps' reads of blocks that these loads now overwrite.

`finish()` completes every layer: on CUDA the compute stream then waits on the last event, so
all later work on it (the next step's offloads, which read the device cache back to the host
with a synchronising copy, its copy-on-write copies and forward) comes after the loads. The
loads read host memory only when they are staged, so a host block freed by a load can be reused
by any offload queued after it, in the same step or later. A staging buffer is a pinned block of
PyTorch's caching host allocator, which records the side stream's copy from it and hands the
block out again only once that copy has finished; besides, the runner keeps its last finished
load (`last_load`, and so its buffers) until another one finishes, by which time the step's
sampling has synchronised the compute stream, and with it every copy of that load.

Order. Every queued write runs layer by layer in the order it was queued. A device-to-device
copy (copy-on-write) that reads or overwrites a block a queued write targets, or overwrites a
block a queued copy reads, joins the queue (`conflicts`), so a copy of the partly matched last
block of a loaded prefix copies the loaded data; any other copy runs at once on the compute
stream, since it commutes with the queue. An offload that reads a block the queue writes must
wait for it (`writes_any`): the runner finishes the queue first. If a layer fails, what ran is
remembered per layer (`_done`), so finishing again later resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CACHE_BLOCK_DIM = 1  # of one layer's slice of the cache, [K/V, block, slot, head, dim]


@dataclass(slots=True)
class _Write:
    """Device blocks `dst[i]` of every layer get `rows[layer][:, i]` (a load from staged host
    rows) or, when `rows` is None, device blocks `src[i]` (a copy)."""

    dst: list[int]
    rows: torch.Tensor | None = None  # [layers, 2, len(dst), ...]
    src: list[int] | None = None
    dst_index: torch.Tensor | None = None  # on the cache's device, made when first run
    src_index: torch.Tensor | None = None


class LayeredLoad:
    """Queued writes into `kv_cache` (`[2, layers, blocks, ...]`), run one layer at a time.

    `stream`: the side stream the writes are issued on (CUDA), or None to run each layer
    synchronously on the current stream when it is waited for (CPU)."""

    def __init__(self, kv_cache: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        self.kv_cache = kv_cache
        self.num_layers = kv_cache.shape[1]
        self.stream = stream
        self.writes: list[_Write] = []
        self.events: list[torch.cuda.Event] = []  # one per layer, recorded by `start` (CUDA)
        self._done = [0] * self.num_layers  # writes of each layer that have run (or been issued)
        self._written: set[int] = set()  # device blocks the writes target
        self._read: set[int] = set()  # device blocks the copies read

    def add_load(self, rows: torch.Tensor, dst: list[int]) -> None:
        """Device blocks `dst[i]` get the staged host rows `rows[:, :, i]` (`[layers, 2, n, ...]`)."""
        self.writes.append(_Write(list(dst), rows=rows))
        self._written.update(dst)

    def add_copy(self, src: list[int], dst: list[int]) -> None:
        """Device blocks `src[i] -> dst[i]`, after the writes queued before it, layer by layer."""
        self.writes.append(_Write(list(dst), src=list(src)))
        self._written.update(dst)
        self._read.update(src)

    def conflicts(self, src: list[int], dst: list[int]) -> bool:
        """Whether a copy `src -> dst` must run after the queue: it reads a block the queue
        writes, or writes a block the queue writes or reads."""
        return any(b in self._written for b in src) or any(b in self._written or b in self._read for b in dst)

    def writes_any(self, blocks: list[int]) -> bool:
        return any(b in self._written for b in blocks)

    def start(self) -> None:
        """CUDA: issues every layer's pending writes on the side stream, after the work queued
        so far on the current stream, and records one event per layer. CPU: nothing (the
        layers run in `wait`)."""
        if self.stream is None:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        events = []
        with torch.cuda.stream(self.stream):
            for layer in range(self.num_layers):
                self._run_layer(layer)
                events.append(torch.cuda.Event())
                events[-1].record(self.stream)
        self.events = events

    def wait(self, layer: int) -> None:
        """Returns when layer `layer`'s writes are done (CPU) or ordered before whatever the
        current stream runs next (CUDA, after `start`)."""
        if self.stream is None:
            self._run_layer(layer)
        else:
            torch.cuda.current_stream(self.kv_cache.device).wait_event(self.events[layer])

    def finish(self) -> None:
        """Completes every layer (resuming after a failure): the rest of the layers copied
        (CPU), or issued, with the current stream then waiting on the last layer (CUDA)."""
        if self.stream is None:
            for layer in range(self.num_layers):
                self._run_layer(layer)
        else:
            self.start()
            self.wait(self.num_layers - 1)

    def _run_layer(self, layer: int) -> None:
        cache = self.kv_cache[:, layer]
        while self._done[layer] < len(self.writes):
            write = self.writes[self._done[layer]]
            if write.dst_index is None:
                write.dst_index = _index(write.dst, cache.device)
                write.src_index = _index(write.src, cache.device) if write.src is not None else None
            if write.rows is not None:
                rows = write.rows[layer].to(cache.device, non_blocking=True)
            else:
                rows = cache.index_select(CACHE_BLOCK_DIM, write.src_index)
            cache.index_copy_(CACHE_BLOCK_DIM, write.dst_index, rows)
            self._done[layer] += 1


def send(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor of ids on `device`; on CUDA sent from pinned memory, so the host does not wait."""
    if device.type == "cuda":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


def _index(blocks: list[int], device: torch.device) -> torch.Tensor:
    return send(torch.tensor(blocks, dtype=torch.long, device="cpu"), device)
