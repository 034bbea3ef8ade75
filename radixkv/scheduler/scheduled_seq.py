"""One entry of a step's batch: `ScheduledSeq`, the chunk of one request's sequence that the
step computes. The scheduler makes the batch, the model runner reads it as it is (a
`ScheduledSeq` is a `SequenceChunk`), and sampling and the commit read it back; its own module
so that each of the scheduler's rooms types it without importing the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.scheduler.chunk import SequenceChunk
from radixkv.scheduler.request import Request, Sequence


@dataclass(slots=True, init=False)
class ScheduledSeq(SequenceChunk):
    """The chunk of `seq` (a sequence of `request`) computed this step: `num_tokens` tokens from
    position `start`, with logits (`"last"`) when they reach the sequence's last token (a decode,
    or a prompt's last chunk). The batch goes to the model runner as it is: building a second
    object per sequence for the runner took 80 us of a 256-sequence decode step."""

    request: Request
    seq: Sequence

    def __init__(self, request: Request, seq: Sequence, start: int, num_tokens: int) -> None:
        end = start + num_tokens
        self.request, self.seq = request, seq
        self.token_ids, self.start_pos, self.block_table = seq.tokens[start:end], start, seq.table.blocks
        self.group_tables = seq.table.extra
        self.logits = "last" if end == len(seq.tokens) else "none"
        if request.prompt_logprobs is not None and start < seq.num_prompt_tokens:
            self.logits = "all"  # the prompt's logprobs: one row per token, the last maybe sampled
