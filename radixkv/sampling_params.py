"""What a request asks of generation, validated at the door.

Every check names the field and the allowed range, so a bad request fails before any work and
leaves every other request untouched. Types are checked as strictly as ranges: a `bool` is not an
integer here, a number must be finite, and a string where a number belongs is refused here rather
than inside a step, where it would fail a whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from radixkv.excerpt import excerpt
from radixkv.structured.spec import StructuredOutputs

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's API allows
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
"""Each stop string's length at most. The detokenizer holds back the last `len(stop) - 1`
characters of text until it knows they do not begin a stop string, so a 1 MB stop string would
keep a stream silent for its first million characters; 1,024 holds any real delimiter."""
INT64_MAX = 2**63 - 1
"""Integers the sampler turns into tensors must fit int64; a larger `top_k` overflowed in a step."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What `torch.Generator.manual_seed` takes: any int64 or uint64."""


def sample_seed(seed: int, k: int) -> int:
    """The seed of sample `k` of a seeded request with `n` samples: `seed + k`, wrapped to uint64
    as a generator keeps it, so that the last seeds of the range have samples too."""
    return (seed + k) % 2**64


GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature below this is greedy, as in vLLM: dividing logits by 1e-45 overflows them to
infinities, and a softmax of infinities is NaN."""
MAX_LENGTH_PENALTY = 5.0
"""Beam scores (float32 sums of logprobs) divide by `length ** length_penalty`; within +-5 a score
as large as 1e8 stays below float32's 3.4e38 for every length up to 2**20 tokens
(1e8 x 2**100 = 1.3e38); past it a long beam's score overflows to infinity."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: object, low: int, high: int = INT64_MAX) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {excerpt(value)}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {excerpt(value)}")


@dataclass(slots=True)
class SamplingParams:
    """Sampling for `generate` and `stream`.

    `temperature == 0` is greedy, and so is any temperature below 1e-5 (`GREEDY_BELOW_TEMPERATURE`).
    `top_k == -1` and `top_p == 1.0` switch those filters off; a `top_k` above the vocabulary
    keeps the whole vocabulary. Integers are bounded by int64 and `seed` by `SEED_RANGE`.
    `seed` makes a request reproducible whatever else shares its batch. `n` samples share the
    prompt's KV blocks and copy only the partly filled last block when they write. `stop`
    strings end a sample (finish_reason "stop") whose text then ends before the stop string,
    even when the string spans several tokens (at most 16 strings of at most 1,024 characters
    each: `MAX_STOP_STRINGS`, `MAX_STOP_CHARS`). `logprobs` k (0 to 20) returns each generated
    token's log-probability and the k most likely alternatives; None returns none.
    `prompt_logprobs` k (0 to 20) does the same for every prompt token but the first (which has
    no context): those positions are computed even when the prefix cache holds them.

    Logits processors, applied in this order before temperature (`radixkv.sampling.logits_processors`):
    `min_tokens` forbids EOS and `stop_token_ids` until that many tokens are generated;
    `logit_bias` (token id -> -100 to 100) is added; `repetition_penalty` (> 0, 1 off) divides
    a positive logit and multiplies a negative one of every token in the prompt or output, as
    transformers does; `presence_penalty` and `frequency_penalty` (-2 to 2, OpenAI's) subtract
    `presence * (count > 0) + frequency * count` over the output's tokens. `min_p` (0 to 1, 0 off)
    drops, after top-k and top-p, tokens less likely than `min_p` times the most likely one.
    Logprobs stay those of the unprocessed distribution.

    `structured_outputs` (`radixkv.structured.StructuredOutputs`: a JSON schema, any JSON object,
    a regex, a choice or a Lark grammar) masks every token the grammar cannot take next, after
    the processors; EOS is allowed only where the grammar may end, and the sample finishes
    ("stop") as soon as the grammar is complete. Needs a model with a fast tokenizer.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    structured_outputs: StructuredOutputs | None = None
    # Whether a logits processor is on (set by `validate`): read once per row per step.
    processes_logits: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range. Run again at submission, since
        a caller may have changed a field after construction."""
        _check_int("max_tokens", self.max_tokens, 1)
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 is greedy), got {excerpt(self.temperature)}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {excerpt(self.top_p)}")
        if not _is_int(self.top_k) or self.top_k == 0 or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(
                f"top_k must be -1 (off) or an integer in [1, {INT64_MAX}], got {excerpt(self.top_k)}"
            )
        low, high = SEED_RANGE
        if self.seed is not None and (not _is_int(self.seed) or not low <= self.seed <= high):
            raise ValueError(
                f"seed must be None or an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], "
                f"got {excerpt(self.seed)}"
            )
        _check_int("n", self.n, 1)
        _check_bool("ignore_eos", self.ignore_eos)
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            _is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {excerpt(self.stop_token_ids)}"
            )
        if (
            not isinstance(self.stop, list | tuple)
            or len(self.stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise ValueError(
                f"stop must be a list of at most {MAX_STOP_STRINGS} non-empty strings, "
                f"got {excerpt(self.stop)}"
            )
        long = next((i for i, s in enumerate(self.stop) if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_CHARS} characters each; "
                f"stop[{long}] has {len(self.stop[long])}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {excerpt(value)}"
                )

        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {excerpt(value)}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a number > 0 (1 is off), got {excerpt(self.repetition_penalty)}"
            )
        bias = self.logit_bias
        if bias is not None and (
            not isinstance(bias, dict)
            or not all(_is_int(t) and t >= 0 and _is_real(v) and -100 <= v <= 100 for t, v in bias.items())
        ):
            raise ValueError(
                f"logit_bias must map token ids to numbers in [-100, 100], got {excerpt(self.logit_bias)}"
            )
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {excerpt(self.min_p)}")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                kind = type(self.structured_outputs).__name__
                raise ValueError(f"structured_outputs must be a StructuredOutputs, got {kind}")
            self.structured_outputs.validate()
        self.processes_logits = bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search for `beam_search`, with the semantics of transformers' `generate`.

    A finished hypothesis scores `sum(logprobs) / generated_length ** length_penalty`, as
    transformers scores it. `early_stopping=True` stops once `beam_width` hypotheses are
    finished; False stops when the best running beam, scored at its current length, cannot beat
    the worst finished one; "never" scores it at the longest length it could still reach. Beams
    also end at the engine's `max_model_len` (finish_reason "length").
    """

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range."""
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        if not _is_real(self.length_penalty) or abs(self.length_penalty) > MAX_LENGTH_PENALTY:
            raise ValueError(
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {excerpt(self.length_penalty)}"
            )
        if not (
            self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"
        ):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {excerpt(self.early_stopping)}"
            )
        _check_bool("ignore_eos", self.ignore_eos)
