"""Megatron-style sharding of a loaded model by its own tensor-parallel plan.

transformers publishes, for each architecture, which linear layers of the base model split how
(`config.base_model_tp_plan`, e.g. `{"layers.*.self_attn.q_proj": "colwise", ...,
"layers.*.self_attn.o_proj": "rowwise", ...}`). This module applies that plan to one rank's copy
of the weights, in place: a `colwise` linear keeps its rank's slice of output features (and of
its bias), a `rowwise` linear keeps its rank's slice of input features and all-reduces its output
over the ranks (its bias, if any, is added by rank 0 alone). Within one attention layer q/k/v are
column then o_proj row parallel, and within one MLP gate/up then down, so every rank computes
whole heads and whole MLP columns and the two all-reduces per layer give every rank the full
hidden state. Embeddings, norms and the LM head are not in the plan and stay replicated.

Slices under an attention module (one with `head_dim`) are whole heads. When a projection has
fewer heads than ranks (GQA with fewer KV heads than `size`), each head is replicated on
`size / heads` ranks, as in vLLM: rank r keeps head `r * heads // size`, which is exactly the KV
head its query heads attend to.

`plan_shards` checks everything before any process starts and raises ValueError naming the
layer and sizes; `shard_model` applies it on one rank.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

from radixkv.config import EngineConfig
from radixkv.model.loader import LoadedModel, auto_dtype, load_model

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place
Style = Literal["colwise", "rowwise"]
SUPPORTED_STYLES: tuple[Style, ...] = ("colwise", "rowwise")


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """How one linear layer (`name`, relative to the whole model) splits over `size` ranks.

    `unit` is the width of one indivisible piece of the split dimension (a head's `head_dim`, or
    1 for MLP features); `units` is how many there are; `replicated` means fewer units than ranks,
    so each rank keeps one unit, shared with `size / units` others.
    """

    name: str
    style: Style
    unit: int
    units: int
    size: int

    @property
    def replicated(self) -> bool:
        return self.units < self.size

    def keep(self, rank: int) -> slice:
        """The range of the split dimension that `rank` keeps."""
        if self.replicated:
            first = rank * self.units // self.size
            return slice(first * self.unit, (first + 1) * self.unit)
        per_rank = self.units // self.size
        return slice(rank * per_rank * self.unit, (rank + 1) * per_rank * self.unit)


def load_whole(config: EngineConfig, device: torch.device) -> LoadedModel:
    """The whole model in host memory, ready to be sharded and then moved to `device`: loaded on
    the CPU, so that no device ever holds more than its shard, in the dtype the engine would give
    it on `device` (`"auto"` resolves for `device`, not for the CPU)."""
    loaded = load_model(config.model, dtype=config.dtype, device="cpu", seed=config.seed)
    if config.dtype == "auto":
        loaded.model.to(auto_dtype("auto", loaded.config, device))
    return loaded


def plan_shards(loaded: LoadedModel, size: int) -> list[ShardSpec]:
    """The shard of every linear layer the model's plan names, checked for `size` ranks.

    Raises ValueError when the architecture has no plan, the plan uses a style other than
    colwise/rowwise, or a layer's heads or features do not divide among `size` ranks (a colwise
    projection with fewer heads than ranks is replicated instead, when `size` is a multiple).
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    model = loaded.model
    plan = getattr(loaded.config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan)")
    base_prefix = model.base_model_prefix
    base = getattr(model, base_prefix)
    patterns = [(_pattern(key), key, style) for key, style in plan.items()]
    specs = []
    for name, module in base.named_modules():
        match = next(((key, style) for regex, key, style in patterns if regex.match(name)), None)
        if match is None:
            continue
        key, style = match
        if style not in SUPPORTED_STYLES:
            raise ValueError(f"tensor parallelism supports {SUPPORTED_STYLES} plans, but {key} is {style!r}")
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name} is planned {style} but is a {type(module).__name__}, not a Linear")
        parent = base.get_submodule(name.rpartition(".")[0])
        specs.append(_spec(f"{base_prefix}.{name}", module, parent, style, size))
    if not specs:
        raise ValueError(f"the tensor-parallel plan of {type(model).__name__} matches no layer")
    return specs


def _pattern(key: str) -> re.Pattern[str]:
    """A plan key (`layers.*.mlp.up_proj`) as a regex over module names, `*` a layer index."""
    return re.compile(re.escape(key).replace(r"\*", r"\d+") + "$")


def _spec(name: str, linear: nn.Linear, parent: nn.Module, style: Style, size: int) -> ShardSpec:
    width = linear.out_features if style == "colwise" else linear.in_features
    head_dim = getattr(parent, "head_dim", None)
    unit = head_dim if isinstance(head_dim, int) else 1
    what = "heads" if unit > 1 else ("output features" if style == "colwise" else "input features")
    units = width // unit
    spec = ShardSpec(name, style, unit, units, size)
    if units % size == 0 or (spec.replicated and style == "colwise" and unit > 1 and size % units == 0):
        return spec
    raise ValueError(
        f"tensor_parallel_size {size} does not divide the {units} {what} of {name} ({style}); "
        f"use a size that divides {units}"
        + (" or a multiple of it" if style == "colwise" and unit > 1 else "")
    )


def shard_model(loaded: LoadedModel, specs: list[ShardSpec], rank: int, all_reduce: AllReduce) -> LoadedModel:
    """Keeps `rank`'s slice of every planned layer of `loaded.model` (in place) and all-reduces
    every rowwise output with `all_reduce`. Returns the rank's `LoadedModel`: the same model, with
    a config whose head counts are the rank's, so that the runner sizes its KV cache and attention
    for the rank's heads."""
    model = loaded.model
    for spec in specs:
        linear = model.get_submodule(spec.name)
        keep = spec.keep(rank)
        with torch.no_grad():
            if spec.style == "colwise":
                linear.weight = nn.Parameter(linear.weight[keep].clone(), requires_grad=False)
                if linear.bias is not None:
                    linear.bias = nn.Parameter(linear.bias[keep].clone(), requires_grad=False)
                linear.out_features = linear.weight.shape[0]
            else:
                linear.weight = nn.Parameter(linear.weight[:, keep].clone(), requires_grad=False)
                if linear.bias is not None and rank != 0:
                    linear.bias = None  # summed once, by rank 0
                linear.in_features = linear.weight.shape[1]
                linear.register_forward_hook(_reduce_output(all_reduce))
    return LoadedModel(
        model=model, config=_rank_config(loaded, specs[0].size), tokenizer=loaded.tokenizer, name=loaded.name
    )


def _reduce_output(all_reduce: AllReduce) -> Callable[[nn.Module, object, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        all_reduce(output)
        return output

    return hook


def rank_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: its share, or 1 when heads are replicated."""
    return max(1, num_kv_heads // size)


def _rank_config(loaded: LoadedModel, size: int) -> PretrainedConfig:
    """A copy of the model's config describing one rank's attention: its query and KV heads, the
    head size made explicit. The model's own config (read by its modules) is left as it was."""
    config = copy.deepcopy(loaded.config)
    config.head_dim = loaded.head_dim
    config.num_attention_heads = loaded.config.num_attention_heads // size
    config.num_key_value_heads = rank_kv_heads(loaded.num_kv_heads, size)
    return config
