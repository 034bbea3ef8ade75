"""Defaults that depend on the device, checked on the CPU: dtype, KV budget, CUDA graph buckets."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from radixkv import EngineConfig
from radixkv.model.cuda_graphs import graph_buckets
from radixkv.model.loader import auto_dtype
from radixkv.model.memory_profile import kv_cache_budget


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_on_cuda():
    half = LlamaConfig(dtype="float16")
    assert auto_dtype("auto", half, "cpu") == torch.float32
    assert auto_dtype("auto", half, "cuda") == torch.float16
    assert auto_dtype("auto", LlamaConfig(dtype="bfloat16"), torch.device("cuda", 0)) == torch.bfloat16
    assert auto_dtype("float16", half, "cpu") == "float16"  # an explicit choice stands


def test_engine_config_takes_auto_and_checks_the_memory_share():
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float64")


def test_engine_on_cpu_runs_float32_by_default():
    from radixkv import Engine

    engine = Engine(EngineConfig(model="tiny-llama", kv_cache_memory="2MiB", device="cpu"))
    assert engine.runner.kv_cache.dtype == torch.float32 and engine.runner.graphs is None


def test_cpu_kv_budget_is_a_share_of_ram_at_most_one_gib(llama_gqa):
    budget = kv_cache_budget(
        llama_gqa, block_size=16, max_num_batched_tokens=4096, max_model_len=2048, gpu_memory_utilization=0.9
    )
    assert 0 < budget <= 1 << 30


def test_graph_buckets_cover_every_batch_size_up_to_the_largest():
    buckets = graph_buckets(100)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 100
    assert buckets == sorted(set(buckets))
    assert graph_buckets(1) == [1] and graph_buckets(16) == [1, 2, 4, 8, 16]
