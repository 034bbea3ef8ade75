"""The step's token masks, filled in a worker thread while the forward pass runs.

The scheduler hands `start` the matchers of the sequences a step will sample, right after it
schedules the step; llguidance fills their rows of one int32 bitmask (bit `t % 32` of word
`t // 32`: token t allowed) in its own threads, without the GIL, while the model computes the
logits. `result` waits for it (usually done by then) and is read once, by the step's
postprocess, which gathers the rows its sampled sequences need and applies them to the logits
in one tensor operation (`radixkv.sampling.logits_processors.apply_token_bitmask`). A matcher in
an error state gets a row that allows nothing, so its request (and only it) fails on the token it
then draws.

The rows are filled through `llguidance.numpy` (into the tensor's memory), not `llguidance.torch`:
that module compiles a function with `torch.compile` when it is imported, which imports
TorchDynamo for a function radixkv never calls: 1.3 s of the 5.8 s that importing the engine
took on a 2-core CPU, in every process that imports it (a launcher, an in-process engine, a
tensor-parallel worker).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.numpy
import torch


class MaskFiller:
    def __init__(self, vocab_size: int, threads: int = 2) -> None:
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(threads)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixkv-grammar-masks")
        self._pending: Future[torch.Tensor] | None = None
        self._rows: dict[int, int] = {}  # id(matcher) -> its row in the pending bitmask

    def start(self, matchers: list[Any]) -> None:
        """Begins filling one row per matcher; the previous fill, if its step failed before
        reading it, is waited for first, so that no matcher is read while it changes."""
        self.discard()
        if not matchers:
            return
        self._rows = {id(m): i for i, m in enumerate(matchers)}
        self._pending = self._pool.submit(self._fill, matchers)

    def rows(self, matchers: list[Any]) -> torch.Tensor:
        """The filled rows of `matchers` (each passed to the last `start`), `[len, words]` int32
        on the CPU."""
        if self._pending is None:
            raise RuntimeError("no token masks were started for this step")
        filled = self._pending.result()
        return filled[[self._rows[id(m)] for m in matchers]]

    def discard(self) -> None:
        if self._pending is not None:
            self._pending.exception()  # waits; an error there shows in `rows`, not here
        self._pending, self._rows = None, {}

    def _fill(self, matchers: list[Any]) -> torch.Tensor:
        bitmask = torch.zeros((len(matchers), self.words), dtype=torch.int32)
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_error()]
        if live:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, live, bitmask.numpy())
        return bitmask

    def close(self) -> None:
        self.discard()
        self._pool.shutdown(wait=False)
