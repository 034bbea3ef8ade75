"""Kernels choose compiled or interpreted per launch from the tensors' device; plans are shareable."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from radixkv.kernels import copy_blocks, paged_attention, plan_paged_attention
from radixkv.kernels.dispatch import interpreted
from radixkv.kernels.reference import paged_attention_ref

from radixkv.interpreter import python_argv


def test_cpu_tensors_are_interpreted_and_cuda_tensors_compiled():
    assert interpreted(torch.device("cpu"))
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not interpreted(torch.device("cuda", 0))


def test_importing_the_kernels_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, radixkv.kernels; print(os.environ.get('TRITON_INTERPRET'))"
    result = subprocess.run(python_argv("-c", code), env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_launches_planned_once_serve_every_layer():
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(12, 4, 2, 16, generator=generator) for _ in range(4)]
    block_table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 6], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 6], dtype=torch.int32)
    q = torch.randn(6, 4, 16, generator=generator)
    launches = plan_paged_attention(
        query_start_loc, seq_lens, block_table, num_tokens=6, num_heads=4, num_kv_heads=2, head_dim=16,
        block_size=4,
    )
    for k_cache, v_cache in (caches[:2], caches[2:]):
        args = (q, k_cache, v_cache, block_table, seq_lens, query_start_loc)
        torch.testing.assert_close(paged_attention(*args, launches=launches), paged_attention_ref(*args))
    with pytest.raises(ValueError, match="planned for 4 heads"):
        paged_attention(
            q[:, :2], caches[0], caches[1], block_table, seq_lens, query_start_loc, launches=launches
        )


def test_an_index_tensor_with_gaps_is_refused():
    k_cache, v_cache = torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16)
    ids = torch.tensor([[1, 5], [2, 6]]).t()  # rows of a transposed tensor: stride 2
    with pytest.raises(ValueError, match="src must be contiguous"):
        copy_blocks(k_cache, v_cache, ids[0], torch.tensor([3, 4]))
