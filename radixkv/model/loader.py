"""Load a causal LM from a preset or a local Hugging Face folder, refusing what the engine cannot run.

The model is transformers' own (`SUPPORTED_ARCHITECTURES`), so rotary embeddings with their
scaling, norms (Qwen3's and Gemma's q/k norms, Gemma's scaled embeddings), q/k/v bias, mixture-of-
experts routing and tied embeddings are exactly those of the checkpoint; `ModelRunner` swaps only
the attention. Local files only: nothing is ever fetched from the hub.

Sliding windows: `LoadedModel.layer_windows` gives each layer's window as transformers masks it
(per layer from `layer_types` where the model reads them, else `sliding_window` for every layer),
and the paged kernel applies it, so a model runs past its window.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from radixkv.model.presets import PRESETS, REAL_SHAPE_PRESETS
from radixkv.model.tokenizer import build_byte_tokenizer

SUPPORTED_ARCHITECTURES: dict[str, type[PreTrainedModel]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
# Models whose mask is chosen per layer from `config.layer_types` ("sliding_attention" or
# "full_attention"); the others (Mistral, Mixtral, Phi-3, Qwen3-MoE) mask every layer with
# `config.sliding_window` when it is set.
_PER_LAYER_WINDOW_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# These recompute rotary frequencies from the longest position in the forward call, which in a
# flattened batch depends on the other sequences; a sequence's output would depend on its batch.
_BATCH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


class ModelLoadError(ValueError):
    """A model that cannot be loaded or served; the message names the folder or field at fault."""


@dataclass
class LoadedModel:
    """A transformers causal LM in eval mode on its device and dtype, with what the engine reads of it."""

    model: PreTrainedModel
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None
    name: str

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads or self.config.num_attention_heads

    @property
    def head_dim(self) -> int:
        config = self.config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids of the config, the generation config and the tokenizer, in that order, without repeats."""
        candidates = [self.config.eos_token_id, self.model.generation_config.eos_token_id]
        if self.tokenizer is not None:
            candidates.append(self.tokenizer.eos_token_id)
        ids: list[int] = []
        for found in candidates:
            for token_id in found if isinstance(found, list) else [found]:
                if token_id is not None and token_id not in ids:
                    ids.append(token_id)
        return ids

    @property
    def max_model_len(self) -> int:
        """Longest sequence served: the position limit (sliding windows apply past their length)."""
        return self.config.max_position_embeddings

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full causal attention), as transformers masks it."""
        return layer_windows(self.config)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window under `config` (None: full attention); see the module docstring."""
    window = getattr(config, "sliding_window", None) or None
    num_layers = config.num_hidden_layers
    if (config.architectures or [None])[0] in _PER_LAYER_WINDOW_ARCHITECTURES:
        types = config.layer_types
        return tuple(window if types[i] == "sliding_attention" else None for i in range(num_layers))
    return (window,) * num_layers


def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str,
    device: torch.device | str,
    seed: int = 0,
) -> LoadedModel:
    """Load a preset (random weights from `seed`) or a local folder (config.json and *.safetensors).

    Raises `ModelLoadError` for a name that is neither, a folder with a missing or broken
    config.json or no weights, and an architecture outside `SUPPORTED_ARCHITECTURES`.
    """
    name = str(name_or_path)
    if name in PRESETS:
        tokenizer = load_tokenizer(name)
        config = PRESETS[name]()
        on_device = name in REAL_SHAPE_PRESETS
        if on_device and torch.device(device).type != "cuda":
            raise ModelLoadError(f"{name} is a real size, for benchmarks on a CUDA device, not {device}")
        return build_random_model(
            config,
            dtype=auto_dtype(dtype, config, device),
            device=device,
            seed=seed,
            tokenizer=tokenizer,
            name=name,
            on_device=on_device,
        )
    folder = Path(name_or_path)
    if not folder.is_dir():
        raise ModelLoadError(
            f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor a local folder; "
            "radixkv loads local files only and never downloads from the hub"
        )
    config_path = folder / "config.json"
    model_class = _model_class(_read_config_json(config_path), config_path)
    try:
        config = model_class.config_class.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as error:
        message = f"{config_path} is not a valid {model_class.__name__} config: {error}"
        raise ModelLoadError(message) from error
    _check_config(config, config_path)
    if not any(folder.glob("*.safetensors")):
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    torch_dtype = _resolve_dtype(auto_dtype(dtype, config, device))
    model = model_class.from_pretrained(folder, config=config, dtype=torch_dtype, local_files_only=True)
    return _finish(model, load_tokenizer(folder), name, device)


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a preset or a local model folder, without loading weights; None for a
    folder that has no tokenizer (such a model still takes token ids)."""
    if str(name_or_path) in PRESETS:
        return build_byte_tokenizer()
    folder = Path(name_or_path)
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return None


def build_random_model(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype | str,
    device: torch.device | str,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    name: str | None = None,
    on_device: bool = False,
) -> LoadedModel:
    """A model of `config.architectures[0]` with weights drawn from `seed`, the same on every machine.

    Weights are drawn in float32 on the CPU and then cast and moved, under a forked RNG so the
    caller's random state is untouched. Biases, which transformers initializes to zero, are drawn
    like the weights so that Qwen2's q/k/v bias takes part in every comparison. `on_device` draws
    them on `device` in `dtype` instead: fast and host-memory free for real sizes, but the values
    then depend on the device's generator.
    """
    model_class = _model_class(config.to_dict(), "the config")
    _check_config(config, "the config")
    device = torch.device(device)
    torch_dtype = _resolve_dtype(dtype)
    with torch.random.fork_rng(devices=[device] if on_device and device.type == "cuda" else []):
        torch.manual_seed(seed)
        if on_device:
            with torch.device(device):
                model = model_class._from_config(config, dtype=torch_dtype)
        else:
            model = model_class(config)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.normal_(module.bias, std=config.initializer_range)
    model.to(torch_dtype)
    return _finish(model, tokenizer, name or f"random-{model_class.__name__}-seed{seed}", device)


def _finish(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, name: str, device: torch.device | str
) -> LoadedModel:
    model.to(device).eval().requires_grad_(False)
    if getattr(model.config, "attn_logit_softcapping", None) is not None and (
        model.config._attn_implementation == "sdpa"
    ):
        # Gemma 2 caps its attention logits, which torch's sdpa cannot: transformers 5.0 picks sdpa
        # for it all the same and drops the cap from the model's own forward (the tests' oracle);
        # later releases refuse sdpa there and pick eager, as this does.
        model.set_attn_implementation("eager")
    return LoadedModel(model=model, config=model.config, tokenizer=tokenizer, name=name)


def _read_config_json(path: Path) -> dict[str, object]:
    if not path.is_file():
        raise ModelLoadError(f"no config.json in {path.parent}: not a Hugging Face model folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _model_class(raw_config: dict[str, object], where: object) -> type[PreTrainedModel]:
    architectures = raw_config.get("architectures") or []
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r} in {where} (model_type "
            f"{raw_config.get('model_type')!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return SUPPORTED_ARCHITECTURES[architecture]


def _check_config(config: PretrainedConfig, where: object) -> None:
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in _BATCH_DEPENDENT_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_type {rope_type!r} in {where} is not supported: its frequencies depend on the longest "
            "position in the batch, so results would depend on batch composition"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError(
            f"use_bidirectional_attention in {where} is not supported: radixkv serves causal decoders"
        )
    num_kv_heads = config.num_key_value_heads or config.num_attention_heads
    if config.num_attention_heads % num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads ({config.num_attention_heads}) in {where} is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )


def auto_dtype(
    dtype: torch.dtype | str, config: PretrainedConfig, device: torch.device | str
) -> torch.dtype | str:
    """`dtype`, or for `"auto"`: on CUDA the checkpoint's floating dtype (`config.dtype`; bfloat16
    when it records none, float16 where bfloat16 is unsupported); on the CPU float32, since CPU
    half-precision matmuls are slow and the interpreter computes in float32 anyway."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type != "cuda":
        return torch.float32
    recorded = getattr(config, "dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    if isinstance(recorded, torch.dtype) and recorded in (torch.float16, torch.bfloat16, torch.float32):
        return recorded
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ModelLoadError(f"dtype must be a floating torch dtype such as 'bfloat16', not {dtype!r}")
    return resolved
