"""A step's logits turned into tokens, not yet appended (`SampledStep`; `step_commit` appends).

Rows are sorted into sampled ones and beam ones in one pass; one `sample` call serves every
sampled row. A request whose own rows make the sampler raise fails alone: its neighbours are
sampled again without it. A prompt with `n > 1` forks into its samples at its first token, and a
prompt's logprobs are recorded as its chunks are computed.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from radixkv.outputs import TokenLogprob
from radixkv.sampling.logits_processors import TokenMask
from radixkv.sampling.sampler import compute_logprobs, make_generator, sample, token_logprobs
from radixkv.sampling_params import sample_seed
from radixkv.scheduler.request import Request, Sequence
from radixkv.scheduler.scheduled_seq import ScheduledSeq


class SampledStep(NamedTuple):
    """A step's tokens before they are appended (`Scheduler.sample_step`, then `commit`):
    sampled sequence j is `requests[j]`'s `seqs[j]`, with `tokens[j]` (None when its request's
    sampling raised, in `failed`) and logprob `records[j]`; `beam_rows` are the beam groups
    whose rows were scored; `batch` the step's entries."""

    batch: list[ScheduledSeq]
    requests: list[Request]
    seqs: list[Sequence]
    tokens: list[int | None]
    records: list[TokenLogprob | None]
    beam_rows: dict[str, Request]
    failed: dict[str, tuple[Request, Exception]]


class StepSampling:
    """Mixed into `Scheduler`, which holds `kv`, `eos`, the mask filler (`_masks`) and the
    step's start (`_scheduled_at`)."""

    def sample_step(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> SampledStep:
        """The step's tokens, not yet appended (`commit` does). An entry whose sequence has
        ended since it was scheduled (finished a step early, aborted, preempted, failed: its
        table is gone) has its rows skipped: with overlap its extra token is discarded.

        One pass over the batch sorts its rows into sampled ones and beam ones, then one `sample`
        call (one argmax for a greedy batch) and one `.tolist()` serve every sampled row. When
        the rows are the logits in order (no beams, no forks), they are not gathered: indexing
        256 rows by a list cost 110 us."""
        now = time.perf_counter()
        self.step_s = now - self._scheduled_at
        requests: list[Request] = []  # sampled: sequence j of `seqs` is request j's, from row `rows[j]`
        seqs: list[Sequence] = []
        rows: list[int] = []
        grammars: list = []  # per sampled row, the matcher whose mask it takes (a fork: its parent's)
        beam_rows: dict[str, Request] = {}
        forked = False  # the sampled rows are not the logits in order
        row = 0
        for item in batch:
            seq, request = item.seq, item.request
            if seq.table is None:
                if item.logits != "none":
                    row += len(item.token_ids) if item.logits == "all" else 1
                    forked = True  # the sampled rows skip these
                continue
            if item.logits == "all":
                num_rows = len(item.token_ids)
                _record_prompt_logprobs(request, item.start_pos, logits[row : row + num_rows])
                forked = True
                row += num_rows - 1  # the last row: sampled if the chunk ends the prompt
                if item.start_pos + num_rows < len(seq.tokens):
                    row += 1
                    continue
            elif item.logits != "last":
                continue
            if request.is_beam_search:
                seq.logprobs = compute_logprobs(logits[row])
                beam_rows[request.request_id] = request
            elif request.params.n > 1 and not request.prompt_done:
                request.seqs += [self._fork(seq, k) for k in range(1, request.params.n)]
                forked = True
                for s in request.seqs:
                    requests.append(request)
                    seqs.append(s)
                    rows.append(row)
                    grammars.append(seq.grammar)
            else:
                requests.append(request)
                seqs.append(seq)
                rows.append(row)
                grammars.append(seq.grammar)
            row += 1
        failed: dict[str, tuple[Request, Exception]] = {}
        tokens: list[int | None] = []
        records: list[TokenLogprob | None] = []
        if seqs:
            chosen = logits if not forked and not beam_rows else logits[rows]
            tokens, records = self._sample(chosen, requests, seqs, failed, self._token_mask(grammars))
        return SampledStep(batch, requests, seqs, tokens, records, beam_rows, failed)

    def _sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        seqs: list[Sequence],
        failed: dict[str, tuple[Request, Exception]],
        mask: TokenMask | None = None,
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Row i's token and logprob record, batched. If the batch raises, each request's rows are
        sampled alone and a request whose own rows raise goes into `failed` (its tokens None), so
        that one request's parameters can never fail its neighbours. (A seeded neighbour may then
        have drawn twice this step: only in a step that hit such an error.)"""
        params = [request.params for request in requests]
        generators = [seq.generator for seq in seqs]
        try:
            tokens = sample(logits, params, generators, seqs, self.eos, mask)
            return tokens.tolist(), token_logprobs(logits, tokens, [p.logprobs for p in params])
        except Exception:  # find the request at fault below
            pass
        by_request: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            by_request.setdefault(request.request_id, []).append(i)
        out_tokens: list[int | None] = [None] * len(requests)
        out_records: list[TokenLogprob | None] = [None] * len(requests)
        for request_id, rows in by_request.items():
            try:
                own = logits[rows]
                own_params, own_seqs = [params[i] for i in rows], [seqs[i] for i in rows]
                own_mask = _own_mask(mask, rows)
                tokens = sample(own, own_params, [generators[i] for i in rows], own_seqs, self.eos, own_mask)
                records = token_logprobs(own, tokens, [params[i].logprobs for i in rows])
            except Exception as error:
                failed[request_id] = (requests[rows[0]], error)
                continue
            for i, token, record in zip(rows, tokens.tolist(), records, strict=True):
                out_tokens[i], out_records[i] = token, record
        return out_tokens, out_records

    def _token_mask(self, grammars: list) -> TokenMask | None:
        """The structured sampled rows' token mask, or None when no row is structured: the rows
        the step's `_start_masks` filled, in row order."""
        structured = [j for j, g in enumerate(grammars) if g is not None]
        if not structured:
            return None
        return TokenMask(structured, self._masks.rows([grammars[j] for j in structured]))

    def _fork(self, seq: Sequence, k: int) -> Sequence:
        """Sample k of a request with n > 1: shares the prompt's blocks, and draws from its own
        generator (seeded from the request's seed and k) when the request is seeded."""
        generator = None
        if seq.generator is not None:
            generator = make_generator(sample_seed(seq.generator.initial_seed(), k), seq.generator.device)
        return seq.fork(self.kv.fork(seq.table), k, generator)


def _own_mask(mask: TokenMask | None, rows: list[int]) -> TokenMask | None:
    """The part of `mask` for the sampled rows `rows`, renumbered as they are sampled alone."""
    if mask is None:
        return None
    where = {row: j for j, row in enumerate(mask.rows)}
    own = [(k, where[row]) for k, row in enumerate(rows) if row in where]
    if not own:
        return None
    return TokenMask([k for k, _ in own], mask.bitmask[[j for _, j in own]])


def _record_prompt_logprobs(request: Request, start: int, rows: torch.Tensor) -> None:
    """Appends the records of the prompt tokens that `rows` (the logits of positions `start`
    on) predict and that are not recorded yet: row r gives prompt token `start + r + 1`. A
    chunk recomputed after a preemption records nothing twice."""
    records = request.prompt_logprobs
    prompt = request.prompt_ids
    first = max(start, len(records) - 1)
    end = min(start + rows.shape[0], len(prompt) - 1)
    if first >= end:
        return
    targets = torch.tensor(prompt[first + 1 : end + 1], device=rows.device)
    k = request.params.prompt_logprobs
    rows = rows[first - start : end - start]
    new = token_logprobs(rows, targets, [k] * (end - first))
    chosen = rows.gather(1, targets.unsqueeze(1))
    for record, rank in zip(new, ((rows > chosen).sum(dim=1) + 1).tolist(), strict=True):
        record.rank = rank
    records += new
