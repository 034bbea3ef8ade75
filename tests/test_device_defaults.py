"""Defaults that depend on the device, checked on the CPU: dtype, KV budget, CUDA graph buckets."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from radixkv import EngineConfig
from radixkv.model.cuda_graphs import context_widths, graph_buckets, graph_routes
from radixkv.model.loader import auto_dtype
from radixkv.model.memory_profile import DeviceMemory, cuda_budget, graph_memory_estimate, kv_cache_budget


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


GIB = 1 << 30


def test_an_engine_alone_on_the_device_counts_memory_outside_its_allocator_against_its_limit():
    # 100 GiB device, 20 GiB reserved by torch, 2 GiB of context: 78 GiB free.
    memory = DeviceMemory(total=100 * GIB, free=78 * GIB, reserved=20 * GIB)
    assert cuda_budget(memory, peak=22 * GIB, utilization=0.9) == 90 * GIB - 22 * GIB - 2 * GIB


def test_replicas_sharing_a_device_each_get_their_share_and_together_stay_within_the_limit():
    total, utilization, share = 140 * GIB, 0.9, 0.5
    weights, peak, context = 16 * GIB, 18 * GIB, GIB // 2
    used = 0  # by the replicas that already built their caches
    budgets = []
    for _ in range(2):  # one after the other, as the second one sees the first one's cache
        free = total - used - context - weights
        budget = cuda_budget(DeviceMemory(total, free, weights), peak, utilization, share)
        budgets.append(budget)
        used += context + weights + budget
    assert budgets[0] == int(total * utilization * share) - peak
    assert all(b > 0 for b in budgets)
    assert used + 2 * (peak - weights) <= total * utilization + 2 * context
    # Sized as if alone, the first replica would take the device and leave the second nothing.
    alone = cuda_budget(DeviceMemory(total, total - context - weights, weights), peak, utilization)
    second_free = total - (context + weights + alone) - context - weights
    assert cuda_budget(DeviceMemory(total, second_free, weights), peak, utilization, share) < 0


def test_replicas_profiling_at_once_cannot_overcommit_what_is_free():
    memory = DeviceMemory(total=100 * GIB, free=30 * GIB, reserved=10 * GIB)  # others hold the rest
    assert cuda_budget(memory, peak=12 * GIB, utilization=0.9, share=0.5) == 30 * GIB - 10 * GIB


def test_graph_memory_is_the_decode_activations_plus_every_buckets_logits():
    assert graph_memory_estimate(GIB, 4096, 0, 1000) == 0
    buckets = graph_buckets(32)
    assert graph_memory_estimate(4096 * 1000, 4096, 32, 1000) == 32 * 1000 + sum(buckets) * 1000 * 4
    assert graph_memory_estimate(100, 16, 32, 10) == 100 + sum(buckets) * 10 * 4  # never scaled above 1


def test_context_widths_stop_below_each_capacity_where_the_plan_may_split_again():
    # Block size 16: 1,024 keys are 64 blocks, so 63 blocks (1,008 keys) still plan one split.
    assert context_widths(512, 16) == [63, 127, 255, 511, 512]
    assert context_widths(100, 16) == [63, 100]
    assert context_widths(64, 16) == [63, 64]
    assert context_widths(8, 128) == [7, 8]


def test_every_bucket_and_width_replays_the_widest_graph_with_its_plan():
    buckets, widths = [1, 2, 16], [63, 127, 255, 256]

    def plan_of(bucket: int, width: int) -> int:  # splits as the GPU plan takes them, 8 SMs, 1 head
        splits = 1
        while splits < 16 and bucket * splits < 8 and width * 16 >= 2 * splits * 512:
            splits *= 2
        return splits

    routes = graph_routes(buckets, widths, plan_of)
    assert set(routes) == {(b, w) for b in buckets for w in widths}
    for (bucket, width), (graph_bucket, graph_width) in routes.items():
        assert graph_bucket == bucket and graph_width >= width
        assert plan_of(bucket, graph_width) == plan_of(bucket, width)
    # Bucket 16 never splits: one graph. Bucket 1 splits 1, 2, 4, 8 ways: four graphs.
    assert {routes[(16, w)] for w in widths} == {(16, 256)}
    assert len({routes[(1, w)] for w in widths}) == 4
