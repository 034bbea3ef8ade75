"""Output processing: a request's tokens made into what callers get (stream deltas, a finished
request's output, beams), detokenizing where the text is read.

Shared by the engine core (in process) and the front end of an engine in its own process
(`radixkv.engine.process`), whose copies of the requests hold the tokens the core sent; either
way the text is made in the reader's thread, off the step.
"""

from __future__ import annotations

from collections.abc import Callable

from radixkv.outputs import Beam, RequestOutput, Sample, StreamDelta
from radixkv.scheduler.request import Request, Sequence


def stream_deltas(request: Request, seq: Sequence, start: int, end: int, finished: bool) -> list[StreamDelta]:
    """`StreamDelta`s of `seq`'s generated tokens `start` to `end` (exclusive), their text
    detokenized here if the step did not (`Sequence.text_pieces`); the first of all carries
    the request's cached prompt tokens, the last the finish reason when `finished` (then
    `end` is the number of generated tokens). An aborted request ends with a closing delta: no
    token, no text, its finish reason (`StreamDelta`), after the tokens it made since `start`
    (some, when a reader took several steps' news at once).
    Needs no step lock when `end` and `finished` were read under it: a step never rewrites
    what it has published."""
    out = seq.tokens
    base = seq.num_prompt_tokens
    pieces = seq.text_pieces(base + end) if seq.detok is not None else None
    records = seq.token_logprobs
    # Only an abort ends a request without a token of its own (a stop or length comes with the
    # token that caused it), and an aborted text holds nothing back to release here.
    closing = finished and (start == end or seq.finish_reason == "abort")
    deltas = []
    for i in range(start, end):
        record = [records[i]] if records is not None else None
        reason = seq.finish_reason if finished and not closing and i == end - 1 else None
        deltas.append(StreamDelta(out[base + i], pieces[i] if pieces is not None else "", reason, record))
    if closing:
        deltas.append(StreamDelta(None, "", seq.finish_reason))
    if start == 0 and deltas:  # the prefix match is known from admission on
        deltas[0].num_cached_tokens = request.num_cached_tokens or 0
        deltas[0].prompt_logprobs = request.prompt_logprobs
    return deltas


def sample_output(request: Request) -> RequestOutput:
    """A finished sampling request's output, its samples in index order."""
    seqs = sorted(request.finished_seqs, key=lambda s: s.index)
    samples = [
        Sample(s.output_ids, "".join(s.text_pieces()), s.finish_reason, s.token_logprobs) for s in seqs
    ]
    first = request.first_token_time or request.finish_time
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_ids,
        samples=samples,
        num_cached_tokens=request.num_cached_tokens or 0,
        ttft_s=first - request.arrival_time,
        e2e_s=request.finish_time - request.arrival_time,
        prompt_logprobs=request.prompt_logprobs,
    )


def beam_output(request: Request, decode: Callable[[list[int]], str]) -> list[Beam]:
    """A finished beam search's beams, best first (none if it was aborted)."""
    return [Beam(s.output_ids, decode(s.output_ids), s.score, s.finish_reason) for s in request.finished_seqs]


def result_of(request: Request, decode: Callable[[list[int]], str]) -> RequestOutput | list[Beam]:
    """The output or the beams of a finished request, as the request is."""
    return beam_output(request, decode) if request.is_beam_search else sample_output(request)
