"""Named models built from a transformers config with seeded random weights: no download, no files.

`tiny-llama` (the default) is what the CLI, the benchmarks and the engine tests run: 4 layers,
GQA with 8 query heads over 2 KV heads of dim 32, hidden 256, the byte tokenizer's 259 tokens.
It is small so that thousands of tokens of multi-turn chat replay in minutes on a CPU.

Random weights at transformers' usual `initializer_range` (0.02) give nearly flat logits, where
greedy and beam search hinge on near-ties and flip on float noise. The presets use 0.3 instead.
Measured on tiny-llama, seed 0, over 64 greedy tokens after each of 8 ChatML prompts (512 steps),
the top-1/top-2 logit gap has median 1.17, 5th percentile 0.078, 1st percentile 0.013 (at 0.02:
0.065, 0.005, 0.0013); seeds 1 and 2 and tiny-qwen2 give the same picture. In float32 the runner's
logits (up to |19|) differ from transformers' by at most 2e-4 (sdpa and eager differ by 6e-5), far
below those gaps, so greedy and beam outputs do not hinge on float noise.
`tiny-qwen2` is the same size with Qwen2's q/k/v bias (drawn nonzero) and tied embeddings.
`llama-3-8b-shape` and `qwen2.5-1.5b-shape` are real sizes for GPU benchmarks (`REAL_SHAPE_PRESETS`).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

from radixkv.model.tokenizer import BYTE_VOCAB_SIZE, IM_END, PAD_TOKEN, SPECIAL_TOKENS

PRESET_INITIALIZER_RANGE = 0.3
_EOS_ID = 256 + SPECIAL_TOKENS.index(IM_END)
_PAD_ID = 256 + SPECIAL_TOKENS.index(PAD_TOKEN)


_TINY = {
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "initializer_range": PRESET_INITIALIZER_RANGE,
    "bos_token_id": None,
    "eos_token_id": _EOS_ID,
    "pad_token_id": _PAD_ID,
}


def _tiny_llama() -> PretrainedConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"], head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=False, **_TINY
    )


def _tiny_qwen2() -> PretrainedConfig:
    return Qwen2Config(
        architectures=["Qwen2ForCausalLM"], rms_norm_eps=1e-6, tie_word_embeddings=True, **_TINY
    )


def _llama_3_8b_shape() -> PretrainedConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID, dtype="bfloat16",
    )


def _qwen2_5_1_5b_shape() -> PretrainedConfig:
    return Qwen2Config(
        architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID, dtype="bfloat16",
    )


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-qwen2": _tiny_qwen2,
    "llama-3-8b-shape": _llama_3_8b_shape,
    "qwen2.5-1.5b-shape": _qwen2_5_1_5b_shape,
}

REAL_SHAPE_PRESETS = ("llama-3-8b-shape", "qwen2.5-1.5b-shape")
"""Presets of a served model's exact shape (layers, heads, widths, vocabulary) with random
weights, for measuring speed on a GPU (`radixkv bench model`, `replay --model`): drawn directly
on the device in the checkpoint's dtype (bfloat16), since drawing 8B float32 weights on the host
would take 32 GiB and minutes. The byte tokenizer stands in for the real one: prompts use its 259
ids and generated ids it cannot spell decode to nothing. Their outputs mean nothing; their
FLOPs and bytes are the real model's."""
