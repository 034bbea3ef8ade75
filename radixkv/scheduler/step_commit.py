"""A sampled step committed: tokens appended, stops and lengths checked, beam groups stepped,
prompts' computed blocks cached as they go, and finished sequences cached and released.

A structured sequence whose matcher rejects its token, or a beam group whose scoring raises,
fails its request alone (`StepOutcome.failed`); the rest of the step stands.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple

import torch

from radixkv.scheduler.request import Request, Sequence, Status
from radixkv.scheduler.step_sampling import SampledStep


class StepOutcome(NamedTuple):
    """What `postprocess` made of a step: the requests that made tokens or finished, and those
    whose own sampling or beam scoring raised, each with its error (still holding their blocks:
    the engine removes them)."""

    touched: list[Request]
    failed: list[tuple[Request, Exception]]


class StepCommit:
    """Mixed into `Scheduler`, which holds `kv`, `eos`, `max_model_len`, `running` and the beam
    groups (`beams`)."""

    def commit(self, sampled: SampledStep) -> StepOutcome:
        """Appends a sampled step's tokens, steps its beam groups, finishes and caches what is
        done; returns the requests that made tokens or finished, and those that failed. Prompts
        cache their computed blocks first, as they go."""
        now = time.perf_counter()
        touched: dict[str, Request] = {}
        batch, requests, seqs, tokens, records, beam_rows, failed = sampled
        for item in batch:
            seq = item.seq
            if seq.table is not None and seq.num_computed <= seq.num_prompt_tokens:
                self.kv.cache_running(seq.table, seq.tokens, seq.num_computed)
        if seqs:
            append = self._append
            for request, seq, token, record in zip(requests, seqs, tokens, records, strict=True):
                if token is None or request.request_id in failed:  # its request failed
                    continue
                # A matcher in error (its grammar matches nothing more) reads as stopped: it fails
                # the request, never finishes it as "stop" with text the grammar did not complete.
                grammar = seq.grammar
                if grammar is not None and (not grammar.consume_token(token) or grammar.is_error()):
                    error = ValueError(f"structured output rejected token {token}: {grammar.get_error()}")
                    failed[request.request_id] = (request, error)
                    continue
                if record is not None:
                    seq.token_logprobs.append(record)
                append(request, seq, token)
                touched[request.request_id] = request
        for request in beam_rows.values():
            if all(seq.logprobs is not None for seq in request.seqs):
                try:
                    self._beam_step(request)
                except Exception as error:
                    failed[request.request_id] = (request, error)
                    continue
                touched[request.request_id] = request
        for request in touched.values():  # each made tokens this step: one stamp per request
            if request.first_token_time is None:
                request.first_token_time = now
            else:
                request.inter_token_s.append(now - request.last_token_time)
            request.last_token_time = now
            if not request.seqs:
                self.running.remove(request)
                request.status = Status.FINISHED
                request.finish_time = now
        return StepOutcome(list(touched.values()), list(failed.values()))

    def _append(self, request: Request, seq: Sequence, token: int) -> None:
        tokens = seq.tokens
        tokens.append(token)
        params = request.params
        stop_string = False
        if params.stop:  # only a stop string needs the text now; readers detokenize the rest
            seq.detok.push(tokens)
            stop_string = seq.detok.stopped
        grammar_done = seq.grammar is not None and seq.grammar.is_stopped()
        if (
            token in params.stop_token_ids
            or (token in self.eos and not params.ignore_eos)
            or stop_string
            or grammar_done
            or seq.stop_requested
        ):
            seq.finish_reason = "stop"
        elif len(tokens) - seq.num_prompt_tokens >= params.max_tokens or len(tokens) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.kv.cache_finished(seq.table, tokens, seq.num_computed)
            seq.table = None
            request.seqs.remove(seq)
            request.finish_seq(seq, seq.finish_reason)

    def _beam_step(self, request: Request) -> None:
        search = self.beams[request.request_id]
        rows = torch.stack([seq.logprobs for seq in request.seqs])
        for seq in request.seqs:
            seq.logprobs = None
        continuations = search.step(rows, [seq.output_ids for seq in request.seqs])
        parents = request.seqs
        chosen = Counter(0 if len(parents) == 1 else c.parent for c in continuations)
        for i, seq in enumerate(parents):
            if not chosen[i]:  # pruned: its blocks go back before any survivor copies a block
                self.kv.release(seq.table)
                seq.table = None
        before = [list(seq.tokens) for seq in parents]
        beams = []
        reused: set[int] = set()
        for c in continuations:
            p = 0 if len(parents) == 1 else c.parent
            if p in reused:  # a second continuation of one beam: share its blocks
                table = self.kv.fork(parents[p].table)
                beams.append(Sequence(before[p] + [c.token], len(request.prompt_ids), table))
            else:
                reused.add(p)
                parents[p].tokens.append(c.token)
                beams.append(parents[p])
        request.seqs = beams
        if search.done:
            request.finished_seqs = [
                Sequence(
                    request.prompt_ids + tokens,
                    len(request.prompt_ids),
                    score=score,
                    finish_reason="stop" if tokens and tokens[-1] in search.eos else "length",
                )
                for tokens, score in search.results()
            ]
            del self.beams[request.request_id]
