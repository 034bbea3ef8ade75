"""A request and its sequences, from submission to finish.

A request is the unit of scheduling: all its sequences run in the same steps or wait together.
A fresh request has one sequence, its prompt. When the prompt is computed it becomes `n`
samples, or the beams of a beam search, which fork the prompt's sequence and so share its blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixkv.cache.kv_cache_manager import BlockTable
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.outputs import TokenLogprob
from radixkv.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from radixkv.kvstore.store import StoreLookup


PLACEHOLDER = -1
"""A generated token whose step is still in flight (host/device overlap): never a vocabulary id.
It stands at the end of a sequence's tokens only while the engine schedules the next step."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # done, aborted or failed (`Request.error`): the one end of a request


@dataclass(slots=True, eq=False)
class Sequence:
    """Token ids (prompt, then generated) and, while running, the sequence's hold on the KV
    cache. `tokens[table.num_tokens:]` still need their KV computed: the prompt's rest at first,
    then the last sampled token."""

    tokens: list[int]
    num_prompt_tokens: int
    table: BlockTable | None = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    logprobs: torch.Tensor | None = None  # a beam's next-token row, held until its group steps
    score: float | None = None  # a finished beam's score
    index: int = 0  # which of a request's n samples
    detok: IncrementalDetokenizer | None = None  # the generated text, piece by piece (`text_pieces`)
    token_logprobs: list[TokenLogprob] | None = None  # per generated token, when asked for
    ahead: int = 0  # slots of its table that steps in flight (overlap) have not computed yet
    grammar: Any = None  # structured output's matcher (an llguidance LLMatcher), in the sampler's process
    stop_requested: bool = False  # a stop string the front end found: finish "stop" at the next token

    def fork(self, table: BlockTable, index: int, generator: torch.Generator | None) -> Sequence:
        """Sample `index` of the same prompt, before any token is generated: shares the KV."""
        return Sequence(
            list(self.tokens),
            self.num_prompt_tokens,
            table,
            generator,
            index=index,
            detok=self.detok.fork() if self.detok is not None else None,
            token_logprobs=[] if self.token_logprobs is not None else None,
            grammar=self.grammar.deep_copy() if self.grammar is not None else None,
        )

    def text_pieces(self, end: int | None = None) -> list[str]:
        """One piece of text per generated token of `tokens[:end]` (all by default; [] without a
        tokenizer), detokenizing now what the step left (only sequences with stop strings are
        detokenized in the step, or by the front end's reader thread for a core in its own
        process; see `radixkv.engine.detokenizer`). Once the sequence has finished other than by
        abort, the last piece also carries the text held back; an aborted text ends at what its
        tokens released.

        Threads: call it for a finished sequence, under the step lock, or from the one reader of
        a running sequence with an `end` that a step has published (a step appends a token, and
        pushes it when it has stop strings, before it publishes the new length)."""
        detok = self.detok
        if detok is None:
            return []
        tokens = self.tokens
        end = len(tokens) if end is None else end
        detok.catch_up(tokens, end)
        if self.finish_reason not in (None, "abort") and end == len(tokens):
            detok.finish(tokens)
        return detok.pieces[: end - self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is in the cache now: what may be cached in the tree."""
        return self.table.num_tokens - self.ahead

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - (self.table.num_tokens if self.table else 0)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams | BeamSearchParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    finished_seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens found in the cache at first admission
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    inter_token_s: list[float] = field(default_factory=list)  # gaps between the request's steps with tokens
    waited_steps: int = 0
    session_id: str | None = None  # the chat session it is a turn of; tags what it caches
    cache_salt: str | None = None  # its cache namespace: shares blocks only with the same salt
    error: BaseException | None = None  # why the request failed (a RequestError), if it did
    store_lookup: StoreLookup | None = None  # its prompt's way through the KV store, when there is one
    # With `prompt_logprobs`: the records of prompt tokens 0.. so far (token 0's is None).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    is_beam_search: bool = field(init=False)  # its params are BeamSearchParams (read once a step)

    def __post_init__(self) -> None:
        self.is_beam_search = isinstance(self.params, BeamSearchParams)

    @property
    def width(self) -> int:
        """The sequences the request runs once its prompt is computed (`n` or `beam_width`)."""
        p = self.params
        return p.beam_width if isinstance(p, BeamSearchParams) else p.n

    @property
    def num_seqs(self) -> int:
        """Sequences counted against `max_num_seqs`: the forks to come count from admission."""
        return len(self.seqs) if self.prompt_done else self.width

    def finish_seq(self, seq: Sequence, reason: str) -> None:
        """Moves `seq` (already out of `seqs`, its table released) to the finished ones."""
        seq.finish_reason = reason
        self.finished_seqs.append(seq)

    @property
    def max_cached_prompt(self) -> int | None:
        """How many prompt tokens a prefix match may serve, None for no limit: a prompt token
        whose logprob is still wanted needs the logits of the position before it computed."""
        records = self.prompt_logprobs
        if records is None or len(records) >= len(self.prompt_ids):
            return None
        return len(records) - 1

    @property
    def prompt_done(self) -> bool:
        """Whether the prompt's KV is computed (sampling or beam steps have begun)."""
        seq = self.seqs[0] if self.seqs else None
        return seq is None or len(seq.tokens) > seq.num_prompt_tokens
