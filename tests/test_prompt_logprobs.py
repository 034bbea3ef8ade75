"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' log-softmax of the
prompt: positions whose logprobs are asked for are computed even when the prefix cache holds
them, in one step or in chunks."""

from __future__ import annotations

import pytest
import torch

from radixkv import Engine, SamplingParams

PROMPT = list(range(40, 70))  # 30 tokens: several blocks of 4


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("budget", [4096, 7])  # one prefill step, or chunks of 7 tokens
def test_prompt_logprobs_equal_transformers_even_when_cached(reference_models, model_folders, budget):
    engine = Engine.from_pretrained(
        model_folders["llama"], block_size=4, kv_cache_memory="8MiB", max_num_batched_tokens=budget
    )
    want = reference(reference_models["llama"], PROMPT)
    engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))  # caches the prompt
    (out,) = engine.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    assert out.num_cached_tokens == 0  # position 0's logits are needed: nothing may be skipped
    records = out.prompt_logprobs
    assert len(records) == len(PROMPT) and records[0] is None
    for i, record in enumerate(records[1:], start=1):
        assert record.token_id == PROMPT[i]
        assert record.logprob == pytest.approx(want[i - 1, PROMPT[i]].item(), abs=1e-4)
        values, ids = want[i - 1].topk(3)
        assert [t for t, _ in record.top] == ids.tolist()
        assert [lp for _, lp in record.top] == pytest.approx(values.tolist(), abs=1e-4)
    # The generated token is still the greedy choice after the last prompt position.
    assert out.token_ids == [int(want[-1].argmax())]
    engine.check_invariants()


def test_prompt_logprobs_streamed_on_first_delta(small_llama_engine, reference_models):
    deltas = list(small_llama_engine.stream(PROMPT[:9], SamplingParams(max_tokens=2, prompt_logprobs=0)))
    want = reference(reference_models["llama"], PROMPT[:9])
    records = deltas[0].prompt_logprobs
    assert records[0] is None and all(d.prompt_logprobs is None for d in deltas[1:])
    assert [r.logprob for r in records[1:]] == pytest.approx(
        [want[i - 1, PROMPT[i]].item() for i in range(1, 9)], abs=1e-4
    )
    assert all(r.top == [] for r in records[1:])


def test_prompt_logprobs_out_of_range_named():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
