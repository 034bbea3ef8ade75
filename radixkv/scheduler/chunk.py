"""What the scheduler hands the model runner each step: one `SequenceChunk` per sequence.

Its own module so that both sides import it and neither imports the other: the scheduler's
`ScheduledSeq` is a `SequenceChunk` (the runner reads the batch as it is, with no second object
per sequence), and the runner (`radixkv.model.runner`) and its tensor-parallel workers take
chunks in and give logits back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(slots=True)
class SequenceChunk:
    """One sequence's work in one step.

    `token_ids` are the new tokens whose KV is computed now, starting at position `start_pos`
    (= tokens already in this sequence's KV cache). `block_table` lists physical blocks covering
    positions `[0, start_pos + len(token_ids))`. `logits` picks the rows returned: the last new
    token (`"last"`), every new token (`"all"`) or none (`"none"`, a prefill chunk mid-prompt).
    `group_tables`: with KV groups (`radixkv.cache.kv_groups`), the tables of groups 1.., each
    as long as `block_table` (`BlockTable.extra`); `ModelRunner.scratch_groups` gives scratch
    ones to a forward whose KV is never read back (warm-up, benchmarks).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    logits: Literal["last", "all", "none"] = "last"
    group_tables: list[list[int]] = field(default_factory=list)
