"""Loading presets and local folders, and refusing what the engine cannot serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

from radixkv.model.loader import LoadedModel, ModelLoadError, build_random_model, load_model
from radixkv.model.presets import PRESETS


def test_save_pretrained_folder_gives_the_same_logits(tiny_model: LoadedModel, tmp_path: Path) -> None:
    tiny_model.model.save_pretrained(tmp_path)
    tiny_model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32", device="cpu")
    assert type(loaded.model) is type(tiny_model.model)
    assert loaded.eos_token_ids == tiny_model.eos_token_ids == [258]
    assert loaded.tokenizer.encode("héllo") == tiny_model.tokenizer.encode("héllo")
    ids = torch.tensor([[1, 200, 33, 7, 258, 12]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, tiny_model.model(ids).logits, atol=1e-6, rtol=0)


def test_folder_without_tokenizer_loads_with_tokenizer_none(llama_gqa: LoadedModel, tmp_path: Path) -> None:
    llama_gqa.model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert loaded.tokenizer is None
    assert loaded.dtype == torch.bfloat16
    assert not loaded.model.training


def test_tiny_llama_preset_is_seeded_gqa_with_the_byte_tokenizer() -> None:
    loaded = load_model("tiny-llama", dtype="float32", device="cpu", seed=0)
    again = load_model("tiny-llama", dtype="float32", device="cpu", seed=0)
    other = load_model("tiny-llama", dtype="float32", device="cpu", seed=1)
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (4, 2, 32)
    assert loaded.config.num_attention_heads == 8
    assert loaded.vocab_size == len(loaded.tokenizer) == 259
    assert loaded.eos_token_ids == [loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert loaded.max_model_len == 8192
    weight = loaded.model.lm_head.weight
    assert torch.equal(weight, again.model.lm_head.weight)
    assert not torch.equal(weight, other.model.lm_head.weight)


def test_random_build_leaves_the_global_rng_alone(llama_gqa: LoadedModel) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_random_model(llama_gqa.config, dtype="float32", device="cpu")
    assert torch.equal(torch.rand(3), expected)


def test_qwen2_biases_are_random_not_zero(qwen2: LoadedModel) -> None:
    assert qwen2.model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0


def test_mistral_sliding_window_applies_per_layer_not_as_a_length_cap(mistral: LoadedModel) -> None:
    assert mistral.max_model_len == 2048
    assert mistral.layer_windows == (64, 64)


def test_bidirectional_gemma3_is_refused_naming_the_field() -> None:
    config = PRESETS["tiny-gemma3"]()
    config.use_bidirectional_attention = True
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        build_random_model(config, dtype="float32", device="cpu")


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_broken_config_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ModelLoadError, match=r"config\.json is not valid JSON"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path: Path) -> None:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM"
    with pytest.raises(ModelLoadError, match=rf"'GPT2LMHeadModel'.*supported: {supported}"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_folder_without_weights_is_a_clear_error(llama_gqa: LoadedModel, tmp_path: Path) -> None:
    llama_gqa.config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_unknown_name_is_not_fetched_from_the_hub() -> None:
    with pytest.raises(ModelLoadError, match=r"neither a preset.*never downloads"):
        load_model("meta-llama/Llama-3.2-1B", dtype="float32", device="cpu")


def test_batch_dependent_rope_is_refused(tmp_path: Path) -> None:
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=32,
        num_attention_heads=2,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic'"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_bad_dtype_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model("tiny-llama", dtype="int8", device="cpu")
