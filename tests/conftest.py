"""Shared fixtures: tiny seeded float32 models on the CPU, small enough for the Triton interpreter.

Each `LoadedModel` fixture builds a fresh model (a few milliseconds), because a `ModelRunner`
binds the model's attention to its paged cache; a test that wants transformers' own forward as the
oracle takes `copy.deepcopy(loaded.model)` before building the runner, or uses the session-wide
`reference_models` (never bound) with `model_folders` holding the same weights on disk. Weights
use initializer range 0.3 so that greedy choices are not near-ties (see `radixkv.model.presets`).

One torch thread, here and in every process the tests start (servers, engine cores, workers):
the models are too small to gain from a second, and two threads that each wait for the other at
every op's barrier run a tiny matmul several times slower when another process holds a core.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: read when its thread pool starts

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, PreTrainedModel, Qwen2Config

from radixkv import Engine
from radixkv.model.loader import LoadedModel, build_random_model
from radixkv.model.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer

torch.set_num_threads(1)  # torch may have been imported already (a plugin), its pool sized then

TINY_SIZES = {
    "vocab_size": BYTE_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.3,
    "bos_token_id": None,
    "eos_token_id": 258,
    "pad_token_id": 256,
}


def _llama_gqa_config() -> PretrainedConfig:
    return LlamaConfig(architectures=["LlamaForCausalLM"], head_dim=16, **TINY_SIZES)


def _qwen2_config() -> PretrainedConfig:
    return Qwen2Config(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, **TINY_SIZES)


def _build(config: PretrainedConfig, name: str) -> LoadedModel:
    return build_random_model(
        config, dtype=torch.float32, device="cpu", seed=0, tokenizer=build_byte_tokenizer(), name=name
    )


@pytest.fixture
def llama_gqa() -> LoadedModel:
    """Llama, 2 layers, 4 query heads over 2 KV heads of dim 16, untied embeddings."""
    return _build(_llama_gqa_config(), "test-llama-gqa")


@pytest.fixture
def qwen2() -> LoadedModel:
    """Qwen2 of the same size, with (random, nonzero) q/k/v bias and tied embeddings."""
    return _build(_qwen2_config(), "test-qwen2")


@pytest.fixture
def mistral() -> LoadedModel:
    """Mistral of the same size with a 64-token sliding window on every layer."""
    config = MistralConfig(architectures=["MistralForCausalLM"], head_dim=16, sliding_window=64, **TINY_SIZES)
    return _build(config, "test-mistral")


@pytest.fixture(params=["llama_gqa", "qwen2"])
def tiny_model(request: pytest.FixtureRequest) -> LoadedModel:
    """Each of the two main architectures in turn."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def reference_models() -> dict[str, PreTrainedModel]:
    """The `llama_gqa` and `qwen2` weights as plain transformers models ("llama", "qwen2").

    Shared by the session and never bound to a runner: the oracle for `generate` comparisons.
    """
    return {
        "llama": _build(_llama_gqa_config(), "llama").model,
        "qwen2": _build(_qwen2_config(), "qwen2").model,
    }


@pytest.fixture(scope="session")
def model_folders(
    reference_models: dict[str, PreTrainedModel], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """`save_pretrained` folders (config, safetensors, byte tokenizer) of `reference_models`, same keys."""
    folders = {}
    for name, model in reference_models.items():
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        build_byte_tokenizer().save_pretrained(folder)
        folders[name] = folder
    return folders


SMALL_POOL = {"block_size": 4, "kv_cache_memory": "8MiB"}
"""Engine settings of the small engine that a test module shares (`small_llama_engine`)."""


@pytest.fixture(scope="module")
def small_llama_engine(model_folders) -> Engine:
    """The llama of `model_folders` on a small pool (`SMALL_POOL`), one engine per test module."""
    return Engine.from_pretrained(model_folders["llama"], **SMALL_POOL)
