"""The logits processors of `SamplingParams` against transformers' own, row by row on the same
logits, and in a mixed batch where each row must come out as it would alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from radixkv import SamplingParams
from radixkv.sampling.logits_processors import apply_min_p, process_logits
from radixkv.sampling.sampler import sample

VOCAB = 50
EOS = 7


@dataclass
class Seq:
    tokens: list[int]
    num_prompt_tokens: int


def make(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


SEQ = Seq([3, 4, 4, 9, 12, 3, 3, 20, 21, 20], 6)  # prompt 6 tokens, 4 generated
IDS = torch.tensor([SEQ.tokens])


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits = make(1)
    got = process_logits(logits, [SamplingParams(repetition_penalty=penalty)], [SEQ])
    want = RepetitionPenaltyLogitsProcessor(penalty)(IDS, logits.clone())
    torch.testing.assert_close(got, want)


def test_min_tokens_equals_transformers_until_reached():
    logits = make(2)
    params = SamplingParams(min_tokens=5, max_tokens=8)
    got = process_logits(logits, [params], [SEQ], eos_token_ids=[EOS])
    want = MinNewTokensLengthLogitsProcessor(SEQ.num_prompt_tokens, 5, EOS)(IDS, logits.clone())
    torch.testing.assert_close(got, want)
    assert got[0, EOS] == float("-inf")
    done = Seq(SEQ.tokens + [1], SEQ.num_prompt_tokens)  # 5 generated: EOS allowed again
    torch.testing.assert_close(process_logits(logits, [params], [done], eos_token_ids=[EOS]), logits)
    # stop_token_ids count as stoppers too; ignore_eos leaves EOS alone.
    other = SamplingParams(min_tokens=5, max_tokens=8, stop_token_ids=[11], ignore_eos=True)
    got = process_logits(logits, [other], [SEQ], eos_token_ids=[EOS])
    assert got[0, 11] == float("-inf") and got[0, EOS] == logits[0, EOS]


def test_logit_bias_equals_transformers_sequence_bias():
    logits = make(3)
    bias = {5: 2.5, 30: -100.0, 31: 100.0}
    got = process_logits(logits, [SamplingParams(logit_bias=bias)], [SEQ])
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(IDS, logits.clone())
    torch.testing.assert_close(got, want)


def test_presence_and_frequency_follow_openai_over_generated_tokens():
    logits = make(4)
    got = process_logits(logits, [SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4)], [SEQ])
    want = logits.clone()
    for token, count in Counter(SEQ.tokens[SEQ.num_prompt_tokens :]).items():
        want[0, token] -= 0.7 + -0.4 * count
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_equals_transformers(min_p):
    logits = make(5, rows=3)
    want = MinPLogitsWarper(min_p)(IDS.repeat(3, 1), logits.clone())
    torch.testing.assert_close(apply_min_p(logits, torch.full((3,), min_p)), want)


def test_a_mixed_batch_processes_each_row_as_alone_and_leaves_the_rest():
    logits = make(6, rows=4)
    rows = [
        SamplingParams(repetition_penalty=1.5, logit_bias={2: 3.0}),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.0, min_tokens=6, max_tokens=9),
        SamplingParams(presence_penalty=2.0),
    ]
    seqs = [SEQ, SEQ, Seq([1, 2, 2, 2], 1), Seq([9, 9, 8], 2)]
    got = process_logits(logits, rows, seqs, eos_token_ids=[EOS])
    for i, (p, s) in enumerate(zip(rows, seqs, strict=True)):
        alone = process_logits(logits[i : i + 1], [p], [s], eos_token_ids=[EOS])
        torch.testing.assert_close(got[i : i + 1], alone)
    torch.testing.assert_close(got[1], logits[1])
    assert process_logits(logits, [SamplingParams()] * 4, seqs) is logits  # nothing to do: no copy


def test_greedy_sampling_sees_the_processed_logits():
    logits = make(7, rows=2)
    favourite = int(logits[0].argmin())
    params = [SamplingParams(temperature=0, logit_bias={favourite: 100.0}), SamplingParams(temperature=0)]
    tokens = sample(logits, params, [None, None], [SEQ, SEQ])
    assert tokens.tolist() == [favourite, int(logits[1].argmax())]


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 17),  # past max_tokens 16
    ],
)
def test_out_of_range_fields_are_named(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_engine_greedy_with_penalties_equals_transformers_generate(small_llama_engine, reference_models):
    prompt = list(b"abcabcabc")
    params = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.4, min_tokens=10)
    (out,) = small_llama_engine.generate(prompt, params)
    want = (
        reference_models["llama"]
        .generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            repetition_penalty=1.4,
            min_new_tokens=10,
        )[0, len(prompt) :]
        .tolist()
    )
    assert out.token_ids == want
