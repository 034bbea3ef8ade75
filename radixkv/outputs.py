"""What the engine hands back: finished requests, beams, and streamed pieces."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's log-probability under the model's distribution (before temperature
    and top-k/top-p), and the `logprobs` most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # of the token, 1 the most likely (prompt logprobs only)


@dataclass(slots=True)
class Sample:
    """One generated continuation. `token_ids` are the generated tokens only, never the prompt."""

    token_ids: list[int]
    text: str  # ends before the stop string that ended it, if one did
    finish_reason: str  # "stop" (EOS, a stop token or a stop string), "length" or "abort"
    logprobs: list[TokenLogprob] | None = None  # one per token, when `SamplingParams.logprobs` is set


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
    # With `SamplingParams.prompt_logprobs`: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None

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
    """A finished beam-search hypothesis: generated tokens and their length-penalized score.
    `finish_reason` is "stop" when it ended with EOS, else "length" (max_tokens or max_model_len)."""

    token_ids: list[int]
    text: str
    score: float
    finish_reason: str = "length"


@dataclass(slots=True)
class StreamDelta:
    """What `stream` yields per generated token; `finish_reason` is set on the last delta of
    every stream, and on no other.

    `text` is the text this token completes: "" while it ends inside a multi-byte character or
    might begin a stop string; the texts of all deltas joined are the sample's text.

    An aborted request (before its first token or between two tokens: an abort makes no token)
    ends its stream with a closing delta: `token_id` None,
    `text` "", no logprobs, and the finish reason. Only such a delta has no token, so a consumer
    counting or collecting tokens skips `token_id is None`. A stream that ends with a token
    (stop, length) carries its finish reason on that token's delta and has no closing delta."""

    token_id: int | None
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = field(default=None)  # this token's record, when asked for
    num_cached_tokens: int | None = None  # on a request's first delta: prompt tokens the prefix cache served
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta, when asked for
