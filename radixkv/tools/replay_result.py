"""What a replay measures, in process or against a server (`radixkv.tools.replay`,
`radixkv.tools.replay_http`): each turn's timings and token counts, and the run they make up.

A module of its own so that both replays, the report and the plot share these records without
importing one another.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TurnRecord:
    session: str
    turn: int
    due_s: float  # when the turn was due, from the replay's start
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.due_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.due_s

    @property
    def tpot_s(self) -> float:
        return (self.finish_s - self.first_token_s) / max(self.output_tokens - 1, 1)


@dataclass(slots=True)
class RunResult:
    """A replay's turns. `failed` describes each turn whose request failed (its session stops
    there: the next turn's prompt would need the reply); the others are `records`."""

    records: list[TurnRecord]
    wall_s: float
    metrics: dict[str, Any]
    kv_usage_peak: float
    kv_utilization: float
    failed: list[str] = field(default_factory=list)


def progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="turn", leave=False, file=sys.stderr)
