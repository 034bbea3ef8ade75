"""The runner's logits against transformers' own forward and greedy `generate` on the same weights."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import PreTrainedModel

from radixkv.model.loader import LoadedModel
from radixkv.model.runner import ModelRunner
from radixkv.scheduler.chunk import SequenceChunk

ATOL = 1e-4


def reference_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


class BlockAllocator:
    """The simplest allocator: hands out shuffled free blocks, so tables are never contiguous."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size = block_size

    def extend(self, table: list[int], num_tokens: int) -> list[int]:
        """`table` grown to cover `num_tokens` positions."""
        need = -(-num_tokens // self.block_size) - len(table)
        return table + [self.free.pop() for _ in range(need)]


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Batched greedy decoding over the runner: one prefill step, then one token per step."""
    alloc = BlockAllocator(runner.num_blocks, runner.block_size)
    tables = [alloc.extend([], len(p)) for p in prompts]
    chunks = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        next_tokens = runner.forward(chunks).argmax(dim=-1).tolist()
        for i, (chunk, token) in enumerate(zip(chunks, next_tokens, strict=True)):
            outputs[i].append(token)
            end = chunk.start_pos + len(chunk.token_ids)
            tables[i] = alloc.extend(tables[i], end + 1)
            chunks[i] = SequenceChunk([token], end, tables[i])
    return outputs


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_of_different_lengths_matches_transformers(llama_gqa: LoadedModel, block_size: int) -> None:
    reference = copy.deepcopy(llama_gqa.model)
    runner = ModelRunner(llama_gqa, num_blocks=96, block_size=block_size)
    prompts = random_prompts([7, 1, 33, 12])
    alloc = BlockAllocator(runner.num_blocks, block_size)
    chunks = [SequenceChunk(p, 0, alloc.extend([], len(p)), logits="all") for p in prompts]
    logits = runner.forward(chunks)
    expected = torch.cat([reference_logits(reference, p) for p in prompts])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_qwen2_and_mistral_prefill_match_transformers(qwen2: LoadedModel, mistral: LoadedModel) -> None:
    for loaded in (qwen2, mistral):
        reference = copy.deepcopy(loaded.model)
        runner = ModelRunner(loaded, num_blocks=8, block_size=16)
        prompts = random_prompts([9, 20])
        chunks = [SequenceChunk(prompts[0], 0, [5]), SequenceChunk(prompts[1], 0, [2, 7])]
        expected = torch.stack([reference_logits(reference, p)[-1] for p in prompts])
        torch.testing.assert_close(runner.forward(chunks), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_extend_after_cached_prefix_through_shuffled_blocks(tiny_model: LoadedModel, block_size: int) -> None:
    reference = copy.deepcopy(tiny_model.model)
    runner = ModelRunner(tiny_model, num_blocks=64, block_size=block_size)
    prompts = random_prompts([40, 19], seed=1)
    split = [23, 5]
    alloc = BlockAllocator(runner.num_blocks, block_size, seed=2)
    tables = [alloc.extend([], len(p)) for p in prompts]
    work = list(zip(prompts, split, tables, strict=True))
    prefix = [SequenceChunk(p[:s], 0, t, logits="none") for p, s, t in work]
    assert runner.forward(prefix).shape == (0, tiny_model.vocab_size)
    rest = [SequenceChunk(p[s:], s, t, logits="all") for p, s, t in work]
    expected = torch.cat([reference_logits(reference, p)[s:] for p, s in zip(prompts, split, strict=True)])
    torch.testing.assert_close(runner.forward(rest), expected, atol=ATOL, rtol=0)


def test_decode_steps_match_transformers(llama_gqa: LoadedModel) -> None:
    reference = copy.deepcopy(llama_gqa.model)
    runner = ModelRunner(llama_gqa, num_blocks=32, block_size=4)
    prompts = random_prompts([6, 13, 3], seed=3)
    alloc = BlockAllocator(runner.num_blocks, runner.block_size)
    tables = [alloc.extend([], len(p)) for p in prompts]
    runner.forward([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    for step in range(4):
        chunks = []
        for i, prompt in enumerate(prompts):
            prompt.append((17 * step + i) % 256)
            tables[i] = alloc.extend(tables[i], len(prompt))
            chunks.append(SequenceChunk(prompt[-1:], len(prompt) - 1, tables[i]))
        expected = torch.stack([reference_logits(reference, p)[-1] for p in prompts])
        torch.testing.assert_close(runner.forward(chunks), expected, atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers_generate(tiny_model: LoadedModel) -> None:
    reference = copy.deepcopy(tiny_model.model)
    runner = ModelRunner(tiny_model, num_blocks=80, block_size=16)
    prompts = random_prompts([3, 17, 8, 1, 25, 11, 5, 30], seed=4)
    outputs = greedy_generate(runner, [list(p) for p in prompts], max_tokens=32)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32
            )[0, len(prompt) :]
        assert output == expected.tolist()


def test_copy_blocks_copies_every_layer(llama_gqa: LoadedModel) -> None:
    runner = ModelRunner(llama_gqa, num_blocks=6, block_size=4)
    runner.forward([SequenceChunk(random_prompts([8])[0], 0, [1, 3])])
    runner.copy_blocks([1, 3], [4, 0])
    for cache in runner.k_caches + runner.v_caches:
        assert cache[1].abs().sum() > 0
        torch.testing.assert_close(cache[[4, 0]], cache[[1, 3]], atol=0, rtol=0)


def test_cache_is_one_tensor_per_layer_in_kernel_layout(llama_gqa: LoadedModel) -> None:
    runner = ModelRunner(llama_gqa, num_blocks=5, block_size=8)
    assert len(runner.k_caches) == len(runner.v_caches) == llama_gqa.num_layers
    for cache in runner.k_caches + runner.v_caches:
        assert cache.shape == (5, 8, 2, 16) and cache.dtype == torch.float32


def test_bad_chunks_are_refused(mistral: LoadedModel) -> None:
    runner = ModelRunner(mistral, num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="cannot hold"):
        runner.forward([SequenceChunk([1] * 17, 0, [0])])
    with pytest.raises(ValueError, match="max_model_len 2048"):  # the position limit, not the window
        runner.forward([SequenceChunk([1], 2048, [0] * 129)])
    with pytest.raises(ValueError, match="block ids"):
        runner.forward([SequenceChunk([1], 0, [8])])
    with pytest.raises(ValueError, match="no new tokens"):
        runner.forward([SequenceChunk([], 0, [0])])


def test_copy_blocks_refuses_pairs_it_cannot_copy_in_parallel(llama_gqa: LoadedModel) -> None:
    runner = ModelRunner(llama_gqa, num_blocks=6, block_size=4)
    with pytest.raises(ValueError, match="distinct and not sources"):
        runner.copy_blocks([1, 2], [2, 3])
    with pytest.raises(ValueError, match="distinct and not sources"):
        runner.copy_blocks([1, 2], [4, 4])
    with pytest.raises(ValueError, match="block ids"):
        runner.copy_blocks([1], [6])
