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

The other families keep that size and the byte tokenizer, with what sets each apart (`SLIDING_WINDOW`
is 32 tokens, so a short chat already runs past it):
- `tiny-qwen3`: q/k RMSNorms. `tiny-phi3`: fused qkv and gate/up projections, a window on every layer.
- `tiny-gemma2`: sliding and global layers alternating, attention and final logit soft-capping
  (caps of 20 and 15, low enough to bite on these weights), query scale `query_pre_attn_scalar` = 48
  instead of the head size, scaled embeddings, sandwich norms, tied embeddings.
- `tiny-gemma3`: 6 layers, 5 sliding to 1 global as Gemma 3 interleaves them, q/k norms, a rotary
  base per layer kind, no soft-capping.
- `tiny-mixtral`, `tiny-qwen2-moe` (with its gated shared expert), `tiny-qwen3-moe`: 4 experts,
  2 routed per token.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from radixkv.model.tokenizer import BYTE_VOCAB_SIZE, IM_END, PAD_TOKEN, SPECIAL_TOKENS

PRESET_INITIALIZER_RANGE = 0.3
_EOS_ID = 256 + SPECIAL_TOKENS.index(IM_END)
_PAD_ID = 256 + SPECIAL_TOKENS.index(PAD_TOKEN)
SLIDING_WINDOW = 32
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 128}


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
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=_EOS_ID,
        pad_token_id=_PAD_ID,
        dtype="bfloat16",
    )


def _qwen2_5_1_5b_shape() -> PretrainedConfig:
    return Qwen2Config(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=_EOS_ID,
        pad_token_id=_PAD_ID,
        dtype="bfloat16",
    )


def _tiny_qwen3() -> PretrainedConfig:
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"], head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True, **_TINY
    )


def _tiny_phi3() -> PretrainedConfig:
    return Phi3Config(architectures=["Phi3ForCausalLM"], sliding_window=SLIDING_WINDOW, **_TINY)


def _gemma_sizes(layer_types: list[str]) -> dict[str, object]:
    return {
        **_TINY,
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "head_dim": 32,
        "query_pre_attn_scalar": 48,
        "sliding_window": SLIDING_WINDOW,
        "tie_word_embeddings": False,
    }


def _tiny_gemma2() -> PretrainedConfig:
    layer_types = ["sliding_attention", "full_attention"] * 2
    return Gemma2Config(
        architectures=["Gemma2ForCausalLM"],
        attn_logit_softcapping=20.0,
        final_logit_softcapping=30.0,
        **_gemma_sizes(layer_types),
    )


def _tiny_gemma3() -> PretrainedConfig:
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **_gemma_sizes(layer_types))


def _tiny_mixtral() -> PretrainedConfig:
    sizes = {**_TINY, "intermediate_size": _MOE["moe_intermediate_size"]}
    return MixtralConfig(
        architectures=["MixtralForCausalLM"], head_dim=32, num_local_experts=4, num_experts_per_tok=2, **sizes
    )


def _tiny_qwen2_moe() -> PretrainedConfig:
    return Qwen2MoeConfig(
        architectures=["Qwen2MoeForCausalLM"],
        num_experts=4,
        shared_expert_intermediate_size=256,
        **_MOE,
        **_TINY,
    )


def _tiny_qwen3_moe() -> PretrainedConfig:
    return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], head_dim=32, num_experts=4, **_MOE, **_TINY)


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-qwen2": _tiny_qwen2,
    "tiny-qwen3": _tiny_qwen3,
    "tiny-gemma2": _tiny_gemma2,
    "tiny-gemma3": _tiny_gemma3,
    "tiny-phi3": _tiny_phi3,
    "tiny-mixtral": _tiny_mixtral,
    "tiny-qwen2-moe": _tiny_qwen2_moe,
    "tiny-qwen3-moe": _tiny_qwen3_moe,
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
