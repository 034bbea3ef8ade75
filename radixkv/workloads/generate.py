"""Seeded workload generators: the same parameters (seed included) give the same sessions.

All four write token-id sessions, so every length is exact under any tokenizer. Ids are drawn
from `[vocab_low, vocab_size)`; the default `[0, 256)` is the byte tokens of the tiny models'
tokenizer (`radixkv/tokenizer.py`), leaving out its special tokens 256-258. Each kind's
parameters are one dataclass whose fields are also its command-line flags (`workload_commands`
builds the parser from them), so a default lives in one place.

- `chat`: multi-turn chat shaped after vLLM's multi-turn benchmark (`benchmarks/multi_turn`).
- `shared-prefix`: single-turn requests over a few system prompts, after SGLang's
  generated-shared-prefix benchmark.
- `docs`: questions over a few long documents and few-shot preambles, some asked again verbatim.
- `one-use`: Zipf-popular shared prefixes with private suffixes mostly used once, and
  conversations that come back after a heavy-tailed gap (the shape eviction is judged on).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

import numpy as np

from radixkv.workloads.format import Session, Turn
from radixkv.workloads.traces import HashIdTokens

IntRange = tuple[int, int]


class Flag(NamedTuple):
    """A parameter's command-line help and the bounds `check_params` enforces (both ends of a range)."""

    help: str
    minimum: float | None = None
    maximum: float | None = None


def check_params(params: Any) -> None:
    """Checks every `Annotated[..., Flag]` field against its bounds; messages name the flag."""
    for name, hint in typing.get_type_hints(type(params), include_extras=True).items():
        value = getattr(params, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, tuple) and value[0] > value[1]:
            raise ValueError(f"{flag} {value[0]}-{value[1]}: the low end is above the high end")
        lo, hi = hint.__metadata__[0].minimum, hint.__metadata__[0].maximum
        for v in value if isinstance(value, tuple) else (value,):
            if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
                bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise ValueError(f"{flag} must be {bounds}, got {v}")
    if hasattr(params, "vocab_size"):
        vocab_of(params)


@dataclass(slots=True)
class Vocab:
    """The token ids a workload may use: `[low, size)`."""

    size: int = 256
    low: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.size:
            raise ValueError(f"need 0 <= --vocab-low < --vocab-size, got {self.low} and {self.size}")

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        """`n` ids drawn uniformly from the range: every random id run of the generators."""
        return rng.integers(self.low, self.size, n).tolist()

    def hash_tokens(self, hash_block: int) -> HashIdTokens:
        """The trace converters' id-to-tokens mapping over this range."""
        return HashIdTokens(hash_block, vocab_size=self.size, low=self.low)

    def as_meta(self) -> dict[str, int]:
        return {"low": self.low, "size": self.size}


def vocab_of(params: Any) -> Vocab:
    """The id range named by a parameter set's `vocab_size` and `vocab_low` fields."""
    return Vocab(params.vocab_size, params.vocab_low)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> list[float]:
    """`n` arrival times (seconds) of a Poisson process at `rate` per second, the first at 0.

    `rate=inf` puts every arrival at 0. Times are rounded to microseconds to keep files short.
    """
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 (inf: all at once), got {rate}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return [round(float(t), 6) for t in np.cumsum(gaps)]


def _uniform(rng: np.random.Generator, bounds: IntRange) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


@dataclass(slots=True)
class ChatParams:
    """Multi-turn chat: every session's system part is a prefix common to all, then its group's prefix.

    Sessions are dealt to groups round-robin and named `g<group>.s<index>`. A group's prefix length
    is lognormal with the given mean and median = 0.85 x mean, capped at 5 x mean, as in vLLM's
    benchmark; `--groups` equal to `--sessions` gives every session its own prefix, as vLLM does.
    """

    sessions: Annotated[int, Flag("number of sessions", minimum=1)] = 24
    groups: Annotated[int, Flag("groups sharing a system prefix (at most --sessions)", minimum=1)] = 4
    turns: Annotated[IntRange, Flag("user turns per session, MIN-MAX", minimum=1)] = (6, 9)
    common_prefix_tokens: Annotated[int, Flag("system tokens common to all sessions", minimum=0)] = 500
    group_prefix_tokens: Annotated[int, Flag("mean system tokens per group, after those", minimum=0)] = 1000
    user_tokens: Annotated[IntRange, Flag("tokens per user message, MIN-MAX", minimum=1)] = (120, 160)
    reply_tokens: Annotated[IntRange, Flag("max_tokens per reply, MIN-MAX", minimum=1)] = (80, 120)
    rate: Annotated[float, Flag("session arrivals per second (Poisson; inf: all at 0)")] = 1.0
    think: Annotated[float, Flag("seconds between a reply's end and the next user turn", minimum=0)] = 0.0
    seed: Annotated[int, Flag("random seed")] = 0
    vocab_size: Annotated[int, Flag("token ids are drawn below this")] = 256
    vocab_low: Annotated[int, Flag("token ids are drawn from this up")] = 0

    def __post_init__(self) -> None:
        check_params(self)
        if self.groups > self.sessions:
            raise ValueError(f"--groups ({self.groups}) must be at most --sessions ({self.sessions})")


def generate_chat(p: ChatParams) -> list[Session]:
    """Multi-turn sessions whose groups share long system prompts (vLLM multi-turn shape)."""
    rng = np.random.default_rng(p.seed)
    vocab = vocab_of(p)
    common = vocab.draw(rng, p.common_prefix_tokens)
    prefixes = [vocab.draw(rng, n) for n in _lognormal_lengths(rng, p.groups, p.group_prefix_tokens)]
    sessions = []
    for i, arrival in enumerate(poisson_arrivals(rng, p.sessions, p.rate)):
        group = i % p.groups
        turns = []
        for k in range(_uniform(rng, p.turns)):
            user = vocab.draw(rng, _uniform(rng, p.user_tokens))
            turns.append(Turn(user, _uniform(rng, p.reply_tokens), p.think if k else 0.0))
        system = common + prefixes[group]
        sessions.append(Session(f"g{group}.s{i}", turns, arrival, system or None))
    return sessions


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: int) -> list[int]:
    if mean == 0:
        return [0] * n
    median = 0.85 * mean
    sigma = math.sqrt(2 * math.log(mean / median))
    lengths = np.rint(rng.lognormal(math.log(median), sigma, n))
    return np.clip(lengths, 1, 5 * mean).astype(int).tolist()


@dataclass(slots=True)
class SharedPrefixParams:
    """Single-turn requests over a few system prompts (SGLang generated-shared-prefix shape).

    Requests are named `g<group>.q<index>` and shuffled, so groups interleave in arrival order.
    """

    groups: Annotated[int, Flag("number of system prompts", minimum=1)] = 64
    prompts_per_group: Annotated[int, Flag("requests per system prompt", minimum=1)] = 16
    system_tokens: Annotated[IntRange, Flag("tokens per system prompt, MIN-MAX", minimum=1)] = (2048, 2048)
    question_tokens: Annotated[IntRange, Flag("tokens per question, MIN-MAX", minimum=1)] = (128, 128)
    output_tokens: Annotated[IntRange, Flag("max_tokens per reply, MIN-MAX", minimum=1)] = (256, 256)
    rate: Annotated[float, Flag("request arrivals per second (Poisson; inf: all at 0)")] = 4.0
    seed: Annotated[int, Flag("random seed")] = 0
    vocab_size: Annotated[int, Flag("token ids are drawn below this")] = 256
    vocab_low: Annotated[int, Flag("token ids are drawn from this up")] = 0

    def __post_init__(self) -> None:
        check_params(self)


def generate_shared_prefix(p: SharedPrefixParams) -> list[Session]:
    """One-turn sessions, `prompts_per_group` over each of `groups` shared system prompts."""
    rng = np.random.default_rng(p.seed)
    vocab = vocab_of(p)
    systems = [vocab.draw(rng, _uniform(rng, p.system_tokens)) for _ in range(p.groups)]
    order = rng.permutation(p.groups * p.prompts_per_group)
    sessions = []
    for index, arrival in zip(order.tolist(), poisson_arrivals(rng, len(order), p.rate), strict=True):
        group, question = divmod(index, p.prompts_per_group)
        turn = Turn(vocab.draw(rng, _uniform(rng, p.question_tokens)), _uniform(rng, p.output_tokens))
        sessions.append(Session(f"g{group}.q{question}", [turn], arrival, systems[group]))
    return sessions


@dataclass(slots=True)
class DocsParams:
    """Questions over long documents and few-shot preambles, some asked again verbatim.

    Each few-shot preamble is `--shots` examples picked from a pool of 2 x shots shared by all
    preambles and kept in pool order, so preambles that pick the same first examples share that
    prefix and then branch. A question names its context (`doc<k>.q<j>`, `fewshot<k>.q<j>`); a
    repeat (`<original>.r<j>`) resends an earlier question's exact ids, a whole-prompt cache hit.
    With `--one-off P` a new question brings, with chance P, a fresh document of its own
    (`oneoff<j>.q<j>`): blocks used once (or by its repeats), the shape that admission filters.
    """

    documents: Annotated[int, Flag("number of long documents", minimum=0)] = 4
    document_tokens: Annotated[IntRange, Flag("tokens per document, MIN-MAX", minimum=1)] = (2000, 4000)
    few_shot: Annotated[int, Flag("number of few-shot preambles", minimum=0)] = 2
    shots: Annotated[int, Flag("examples per few-shot preamble", minimum=1)] = 8
    shot_tokens: Annotated[IntRange, Flag("tokens per few-shot example, MIN-MAX", minimum=1)] = (64, 128)
    questions: Annotated[int, Flag("number of questions (sessions)", minimum=1)] = 64
    question_tokens: Annotated[IntRange, Flag("tokens per question, MIN-MAX", minimum=1)] = (16, 64)
    answer_tokens: Annotated[IntRange, Flag("max_tokens per answer, MIN-MAX", minimum=1)] = (32, 128)
    repeat: Annotated[float, Flag("chance a question repeats an earlier one", minimum=0, maximum=1)] = 0.25
    one_off: Annotated[
        float, Flag("chance a new question comes with a document of its own, read once", minimum=0, maximum=1)
    ] = 0.0
    rate: Annotated[float, Flag("question arrivals per second (Poisson; inf: all at 0)")] = 2.0
    seed: Annotated[int, Flag("random seed")] = 0
    vocab_size: Annotated[int, Flag("token ids are drawn below this")] = 256
    vocab_low: Annotated[int, Flag("token ids are drawn from this up")] = 0

    def __post_init__(self) -> None:
        check_params(self)
        if self.documents + self.few_shot == 0:
            raise ValueError("need at least one context: --documents or --few-shot must be >= 1")


def generate_docs(p: DocsParams) -> list[Session]:
    """One-turn questions, each over one context (a document or a few-shot preamble)."""
    rng = np.random.default_rng(p.seed)
    vocab = vocab_of(p)
    contexts = [(f"doc{k}", vocab.draw(rng, _uniform(rng, p.document_tokens))) for k in range(p.documents)]
    pool = [vocab.draw(rng, _uniform(rng, p.shot_tokens)) for _ in range(2 * p.shots)]
    for k in range(p.few_shot):
        picks = np.sort(rng.choice(len(pool), p.shots, replace=False)).tolist()
        contexts.append((f"fewshot{k}", [token for i in picks for token in pool[i]]))
    originals: list[Session] = []
    sessions = []
    for j, arrival in enumerate(poisson_arrivals(rng, p.questions, p.rate)):
        if originals and rng.random() < p.repeat:
            first = originals[int(rng.integers(len(originals)))]
            turn = first.turns[0]
            sessions.append(
                Session(f"{first.name}.r{j}", [Turn(list(turn.user), turn.max_tokens)], arrival, first.system)
            )
            continue
        if p.one_off and rng.random() < p.one_off:
            name, context = f"oneoff{j}", vocab.draw(rng, _uniform(rng, p.document_tokens))
        else:
            name, context = contexts[int(rng.integers(len(contexts)))]
        turn = Turn(vocab.draw(rng, _uniform(rng, p.question_tokens)), _uniform(rng, p.answer_tokens))
        originals.append(Session(f"{name}.q{j}", [turn], arrival, context))
        sessions.append(originals[-1])
    return sessions


@dataclass(slots=True)
class OneUseParams:
    """Traffic where most blocks are used once: the shape that tells eviction policies apart.

    Each session's system part is one of `--prefixes` shared prefixes, picked with Zipf
    popularity (`--popularity` is the exponent: 0 uniform, larger concentrates on a few), and its
    first user message is tokens of its own, used once unless the session comes back. With chance
    `--returns` a session comes back for another turn (again after each return), whose prompt is
    the whole conversation so far: the reuse of a long private history. The gap before a return
    is heavy-tailed: Pareto with shape `--gap-tail` scaled so that its median is `--gap-requests`
    requests at the trace's mean request rate, so reuse distances range from a few requests to
    many times the median. A larger `--user-tokens` or fewer returns raise the share of blocks
    used once; a large `--popularity` with short private parts is the recency-friendly end.
    """

    sessions: Annotated[int, Flag("number of sessions", minimum=1)] = 2000
    prefixes: Annotated[int, Flag("number of shared system prefixes", minimum=1)] = 100
    popularity: Annotated[float, Flag("Zipf exponent of the prefixes' popularity", minimum=0)] = 1.0
    prefix_tokens: Annotated[IntRange, Flag("tokens per shared prefix, MIN-MAX", minimum=1)] = (256, 2048)
    user_tokens: Annotated[IntRange, Flag("tokens per user message, MIN-MAX", minimum=1)] = (256, 1024)
    reply_tokens: Annotated[IntRange, Flag("max_tokens per reply, MIN-MAX", minimum=1)] = (16, 64)
    returns: Annotated[
        float, Flag("chance a session comes back for another turn", minimum=0, maximum=0.95)
    ] = 0.3
    gap_requests: Annotated[float, Flag("median requests between a turn and its return", minimum=0)] = 400.0
    gap_tail: Annotated[float, Flag("Pareto shape of the return gap (smaller: heavier)", minimum=0.1)] = 1.2
    rate: Annotated[float, Flag("session arrivals per second (Poisson)", minimum=1e-6)] = 10.0
    seed: Annotated[int, Flag("random seed")] = 0
    vocab_size: Annotated[int, Flag("token ids are drawn below this")] = 256
    vocab_low: Annotated[int, Flag("token ids are drawn from this up")] = 0

    def __post_init__(self) -> None:
        check_params(self)
        if math.isinf(self.rate):
            raise ValueError("--rate must be finite: return gaps are measured against it")


def generate_one_use(p: OneUseParams) -> list[Session]:
    """Sessions over Zipf-popular shared prefixes with private, mostly once-used, suffixes."""
    rng = np.random.default_rng(p.seed)
    vocab = vocab_of(p)
    prefixes = [vocab.draw(rng, _uniform(rng, p.prefix_tokens)) for _ in range(p.prefixes)]
    weights = 1.0 / np.arange(1, p.prefixes + 1) ** p.popularity
    picks = rng.choice(p.prefixes, p.sessions, p=weights / weights.sum()).tolist()
    # Requests per second: sessions times their mean turns (1 + r + r^2 + ... = 1 / (1 - r)).
    request_rate = p.rate / (1.0 - p.returns)
    # Pareto with shape a and scale m has median m * 2^(1/a): m makes the median the one asked.
    scale = p.gap_requests / request_rate / 2 ** (1.0 / p.gap_tail)
    sessions = []
    for i, (arrival, prefix) in enumerate(zip(poisson_arrivals(rng, p.sessions, p.rate), picks, strict=True)):
        think = 0.0
        turns = []
        while True:
            user = vocab.draw(rng, _uniform(rng, p.user_tokens))
            turns.append(Turn(user, _uniform(rng, p.reply_tokens), think))
            if rng.random() >= p.returns:
                break
            think = round(float(scale * (1.0 + rng.pareto(p.gap_tail))), 6)
        sessions.append(Session(f"p{prefix}.s{i}", turns, arrival, prefixes[prefix]))
    return sessions
