"""What the engine hands back: finished requests, beams, and streamed pieces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Sample:
    """One generated continuation. `token_ids` are the generated tokens only, never the prompt."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop token) or "length"


@dataclass(slots=True)
class RequestOutput:
    """A finished request. `token_ids`, `text` and `finish_reason` are its first sample's (the
    only one unless `n > 1`). `num_cached_tokens` prompt tokens came from the prefix cache;
    `ttft_s` is the time from submission to the first generated token."""

    request_id: str
    prompt_token_ids: list[int]
    samples: list[Sample]
    num_cached_tokens: int
    ttft_s: float
    e2e_s: float

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def finish_reason(self) -> str:
        return self.samples[0].finish_reason


@dataclass(slots=True)
class Beam:
    """A finished beam-search hypothesis: generated tokens and their length-penalized score."""

    token_ids: list[int]
    text: str
    score: float


@dataclass(slots=True)
class StreamDelta:
    """What `Engine.stream` yields per generated token; `finish_reason` is set on the last."""

    token_id: int
    text: str
    finish_reason: str | None
