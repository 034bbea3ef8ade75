"""Sampling: filters against a direct computation, seeds independent of the batch, logprobs."""

from __future__ import annotations

import pytest
import torch

from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner
from radixkv.sampling.sampler import apply_top_k_top_p, compute_logprobs, make_generator, sample
from radixkv.sampling_params import SamplingParams
from radixkv.scheduler.chunk import SequenceChunk


def allowed_directly(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p keep, computed one token at a time."""
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    kept = order[:top_k]
    probs = torch.softmax(row[kept].double(), dim=0).tolist()
    allowed, mass = set(), 0.0
    for token, p in zip(kept, probs, strict=True):
        allowed.add(token)
        mass += p
        if mass >= top_p:
            break
    return allowed


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (50, 0.5), (3, 0.9), (64, 0.2), (1, 1.0), (64, 1.0)])
def test_top_k_top_p_keep_exactly_the_direct_computation(top_k: int, top_p: float) -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(top_k)) * 2
    k = torch.full((4,), top_k)
    p = torch.full((4,), top_p)
    filtered = apply_top_k_top_p(logits, k, p)
    for row, out in zip(logits, filtered, strict=True):
        kept = set(torch.nonzero(out > float("-inf")).flatten().tolist())
        assert kept == allowed_directly(row, top_k, top_p)
        assert torch.equal(out[list(kept)], row[list(kept)])


def test_sampled_tokens_stay_inside_the_filter() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(top_k=4), SamplingParams(top_p=0.3), SamplingParams(top_k=10, top_p=0.6)]
    allowed = [
        allowed_directly(row, p.top_k if p.top_k > 0 else 64, p.top_p)
        for row, p in zip(logits, params, strict=True)
    ]
    for _ in range(200):
        tokens = sample(logits, params, [None, None, None]).tolist()
        assert all(t in a for t, a in zip(tokens, allowed, strict=True))


def test_greedy_is_argmax_and_uses_no_randomness() -> None:
    logits = torch.randn(5, 32)
    generator = make_generator(7, "cpu")
    state = generator.get_state()
    tokens = sample(logits, [SamplingParams(temperature=0)] * 5, [generator] * 5)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.equal(generator.get_state(), state)


def test_samples_follow_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.7)]
    generator = make_generator(0, "cpu")
    counts = torch.bincount(
        torch.cat([sample(logits, params, [generator]) for _ in range(4000)]), minlength=4
    ).float()
    torch.testing.assert_close(counts / 4000, torch.softmax(logits[0] / 0.7, dim=0), atol=0.03, rtol=0)


def test_seeded_row_does_not_depend_on_its_batch() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone_gen = make_generator(42, "cpu")
    batched_gen = make_generator(42, "cpu")
    others = [SamplingParams(temperature=0.5), SamplingParams(temperature=0), SamplingParams(seed=3)]
    for step in range(30):
        alone = sample(logits[:1], [mine], [alone_gen])
        noisy = logits[:4] + 1e-6 * torch.randn(4, 100)
        batch = torch.cat([noisy[1:3], noisy[:1], noisy[3:4]])
        batched = sample(
            batch,
            [others[0], others[1], mine, others[2]],
            [None, None, batched_gen, make_generator(step, "cpu")],
        )
        assert batched[2] == alone[0]


def test_seeded_generation_is_reproducible_whatever_shares_the_batch(llama_gqa: LoadedModel) -> None:
    runner = ModelRunner(llama_gqa, num_blocks=16, block_size=8)
    prompt = llama_gqa.tokenizer.encode("hello there")

    def generate(others: list[list[int]], first_block: int, seed: int = 1234) -> list[int]:
        prompts = [prompt, *others]
        tables = [[first_block + 4 * i + j for j in range(4)] for i in range(len(prompts))]
        chunks = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
        params = [SamplingParams(top_k=50, seed=seed)] + [SamplingParams(temperature=0.8)] * len(others)
        generators = [make_generator(seed, "cpu")] + [None] * len(others)
        tokens: list[int] = []
        for _ in range(8):
            step = sample(runner.forward(chunks), params, generators).tolist()
            tokens.append(step[0])
            chunks = [
                SequenceChunk([t], c.start_pos + len(c.token_ids), c.block_table)
                for c, t in zip(chunks, step, strict=True)
            ]
        return tokens

    alone = generate([], 0)
    assert generate([], 4) == alone
    assert generate([[5] * 3, [9] * 11], 0) == alone
    assert generate([], 0, seed=99) != alone


def test_logprobs_are_float32_log_softmax() -> None:
    logits = torch.randn(2, 10, dtype=torch.bfloat16)
    logprobs = compute_logprobs(logits)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, torch.log_softmax(logits.float(), dim=-1))
    torch.testing.assert_close(logprobs.exp().sum(dim=-1), torch.ones(2))


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 logit rows, 1 params"):
        sample(torch.zeros(2, 4), [SamplingParams()], [None])
