"""The logits processors of `SamplingParams`, batched over a step's rows on the logits' device.

Only rows whose params turn a processor on (`SamplingParams.processes_logits`) are touched, and
they are processed together: the token counts of every such row come from one `scatter_add_`
over one tensor of their token ids (a per-step `[rows, vocab]` count), so penalties cost a few
tensor operations whatever the batch, never a Python loop per token. Order, as documented on
`SamplingParams`: `min_tokens`, `logit_bias`, `repetition_penalty`, then presence and frequency.
Each matches its transformers counterpart where one exists (`MinNewTokensLengthLogitsProcessor`,
`SequenceBiasLogitsProcessor` for single tokens, `RepetitionPenaltyLogitsProcessor`); presence
and frequency are OpenAI's formula (over generated tokens only, as vLLM applies them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

import torch

from radixkv.sampling_params import SamplingParams


class History(Protocol):
    """A row's tokens so far: the prompt's `num_prompt_tokens` first, then the generated ones."""

    tokens: list[int]
    num_prompt_tokens: int


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History],
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """`logits [B, V]` (float32) with row i processed by `params[i]` given `histories[i]`; the
    input itself when no row asks, else a new tensor (the caller's stays unprocessed)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    device = logits.device
    chosen = [params[i] for i in rows]
    seen = [histories[i] for i in rows]
    x = logits[rows]  # a copy
    vocab = x.shape[-1]
    _min_tokens(x, chosen, seen, eos_token_ids)
    _logit_bias(x, chosen, vocab)
    if any(p.repetition_penalty != 1 for p in chosen):
        counts = _counts(seen, vocab, device, generated_only=False)
        penalty = torch.tensor([p.repetition_penalty for p in chosen], device=device).unsqueeze(1)
        penalized = torch.where(x > 0, x / penalty, x * penalty)
        x = torch.where(counts > 0, penalized, x)
    if any(p.presence_penalty or p.frequency_penalty for p in chosen):
        counts = _counts(seen, vocab, device, generated_only=True)
        presence = torch.tensor([p.presence_penalty for p in chosen], device=device).unsqueeze(1)
        frequency = torch.tensor([p.frequency_penalty for p in chosen], device=device).unsqueeze(1)
        x = x - frequency * counts - presence * (counts > 0)
    out = logits.clone()
    out[rows] = x
    return out


class TokenMask(NamedTuple):
    """Structured output's allowed tokens for some rows of a step's logits: `bitmask[j]` (int32
    `[len(rows), ceil(V / 32)]`, bit `t % 32` of word `t // 32` set allows token t: llguidance's
    layout, `radixkv.structured.masks`) is row `rows[j]`'s."""

    rows: list[int]
    bitmask: torch.Tensor


_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # byte -> its 8 bits


def apply_token_bitmask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """`logits [B, V]` with every token that `mask` disallows set to -inf, as a new tensor (the
    input stays as it was). A few tensor operations over the masked rows only, on the logits'
    device: the words are read as little-endian bytes and each byte looks up its 8 bits, which
    measured 2x faster on this CPU than shifting every word 32 ways."""
    device = logits.device
    words = mask.bitmask.to(device, non_blocking=True).contiguous()
    bits = _BYTE_BITS.to(device).index_select(0, words.view(torch.uint8).view(-1).int())
    allowed = bits.view(words.shape[0], -1)[:, : logits.shape[-1]]
    rows = torch.tensor(mask.rows, device=device)
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Sets to -inf every logit whose probability is below `min_p[i]` times row i's highest
    (transformers' `MinPLogitsWarper`; the most likely token always stays)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _counts(
    histories: Sequence[History], vocab: int, device: torch.device, generated_only: bool
) -> torch.Tensor:
    """`[rows, vocab]` float counts of each row's tokens (all, or the generated ones only)."""
    lists = [h.tokens[h.num_prompt_tokens :] if generated_only else h.tokens for h in histories]
    flat = torch.tensor([t for tokens in lists for t in tokens], dtype=torch.int64, device=device)
    row = torch.repeat_interleave(
        torch.arange(len(lists), device=device), torch.tensor([len(t) for t in lists], device=device)
    )
    counts = torch.zeros(len(lists) * vocab, device=device)
    counts.scatter_add_(0, row * vocab + flat, torch.ones_like(flat, dtype=counts.dtype))
    return counts.view(len(lists), vocab)


def _min_tokens(
    x: torch.Tensor, params: list[SamplingParams], histories: Sequence[History], eos: Collection[int]
) -> None:
    """Forbids, in place, the tokens that would stop a row short of its `min_tokens`."""
    for j, (p, h) in enumerate(zip(params, histories, strict=True)):
        if p.min_tokens and len(h.tokens) - h.num_prompt_tokens < p.min_tokens:
            stoppers = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            x[j, sorted(stoppers)] = float("-inf")


def _logit_bias(x: torch.Tensor, params: list[SamplingParams], vocab: int) -> None:
    """Adds, in place, each row's `logit_bias` (one `index_put_` for the batch)."""
    entries = [(j, t, b) for j, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if not entries:
        return
    rows, tokens, values = zip(*entries, strict=True)
    index = (torch.tensor(rows, device=x.device), torch.tensor(tokens, device=x.device))
    x.index_put_(index, torch.tensor(values, dtype=x.dtype, device=x.device), accumulate=True)
