"""The scoring of beam search, step by step, exactly as transformers' `generate` does it.

Parity with `model.generate(num_beams=k, num_return_sequences=k, do_sample=False, ...)` is the
contract, so each step mirrors transformers' vectorized beam search with the same float32
tensor operations in the same order (its additive -1e9 masks and topk tie-breaks included):
take the top 2k continuations over all running beams; the best k that did not just end run on;
those among the top k that ended (EOS, or the length limit) compete for the k finished slots,
scored `sum(logprobs) / generated_length ** length_penalty`; then the early-stopping heuristic.

The score tensors live on the device of the log-probabilities (made there at the first step),
and every tensor a step makes is made there, so a search over CUDA logits never meets a CPU tensor.

This class only scores. The engine owns the beams' sequences: a beam that two continuations
choose is forked (its blocks shared), a beam no continuation chooses is released at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixkv.sampling_params import BeamSearchParams

_MASK = -1.0e9


class Continuation(NamedTuple):
    parent: int  # index of the running beam it extends
    token: int


class BeamSearch:
    def __init__(self, params: BeamSearchParams, eos_token_ids: list[int], max_new_tokens: int) -> None:
        """`max_new_tokens`: `params.max_tokens`, or fewer where the engine's `max_model_len`
        leaves less room after the prompt; a beam reaching it ends like one reaching max_tokens."""
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.k = params.beam_width
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.keep = max(2, 1 + len(self.eos)) * self.k  # continuations looked at per step
        self.finished_tokens: list[list[int]] = [[] for _ in range(self.k)]
        # The score tensors are made at the first step, on the log-probabilities' device.
        self.running_scores = self.finished_scores = self.is_finished = torch.empty(0, device="meta")
        self.improvable = True
        self.generated = 0
        self.done = False

    def step(self, logprobs: torch.Tensor, outputs: list[list[int]]) -> list[Continuation]:
        """Takes the running beams' next-token log-probabilities `[beams, V]` (in running order;
        one row, the prompt's, at the first step) and their generated tokens so far; returns the
        next running beams, best first (empty when the search is over)."""
        k, vocab = self.k, logprobs.shape[-1]
        device = logprobs.device
        if self.generated == 0:
            # Every beam is the prompt; only the first may continue, so that the k beams do not
            # all pick the same tokens.
            self.running_scores = torch.tensor([0.0] + [_MASK] * (k - 1), device=device)
            self.finished_scores = torch.full((1, k), _MASK, device=device)
            self.is_finished = torch.zeros((1, k), dtype=torch.bool, device=device)
            logprobs, outputs = logprobs.expand(k, vocab), outputs * k
        scores = (logprobs.float() + self.running_scores[:, None]).reshape(1, -1)
        top_scores, top_index = torch.topk(scores, k=self.keep)
        parents = (top_index // vocab)[0].tolist()
        tokens = (top_index % vocab)[0].tolist()
        length = self.generated + 1
        ends = [[t in self.eos or length >= self.max_new_tokens for t in tokens]]
        ends = torch.tensor(ends, dtype=torch.bool, device=device)

        running = top_scores + ends.to(torch.float32) * _MASK
        next_index = torch.topk(running, k=k)[1]
        self.running_scores = running[0, next_index[0]]
        survivors = [Continuation(parents[i], tokens[i]) for i in next_index[0].tolist()]

        top_k_mask = torch.arange(self.keep, device=device) < k
        just_finished = ends & top_k_mask[None, :]
        candidate = top_scores / (length**self.params.length_penalty)
        full = bool(self.is_finished.all()) and self.params.early_stopping is True
        candidate = candidate + float(full) * _MASK
        candidate = candidate + float(not self.improvable) * _MASK
        candidate = candidate + (~just_finished) * _MASK
        merged_scores = torch.cat((self.finished_scores, candidate), dim=1)
        merged_tokens = self.finished_tokens + [
            outputs[p] + [t] for p, t in zip(parents, tokens, strict=True)
        ]
        merged_flags = torch.cat((self.is_finished, just_finished), dim=1)
        keep = torch.topk(merged_scores, k=k)[1]
        self.finished_scores = merged_scores[:, keep[0]]
        self.is_finished = merged_flags[:, keep[0]]
        self.finished_tokens = [merged_tokens[i] for i in keep[0].tolist()]

        self.generated = length
        self._update_improvable()
        early_full = bool(self.is_finished.all()) and self.params.early_stopping is True
        self.done = not self.improvable or early_full or bool(ends.all())
        return [] if self.done else survivors

    def results(self) -> list[tuple[list[int], float]]:
        """The finished hypotheses (generated tokens, score), best first."""
        return [
            (tokens, float(score))
            for tokens, score, real in zip(
                self.finished_tokens,
                self.finished_scores[0].tolist(),
                self.is_finished[0].tolist(),
                strict=True,
            )
            if real
        ]

    def _update_improvable(self) -> None:
        p = self.params
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.generated
        best_running = self.running_scores[:1] / (best_length**p.length_penalty)
        worst_finished = torch.where(
            self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], _MASK
        )
        self.improvable = self.improvable and bool(torch.any(best_running > worst_finished))
