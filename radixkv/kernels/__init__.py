"""Triton kernels of radixkv: paged attention over block tables, KV store and block copy.

Each launch runs compiled on CUDA tensors and in Triton's interpreter on CPU tensors
(`radixkv.kernels.dispatch`), so a user on a CPU machine gets working kernels without setting
anything, and the process environment is left alone.
"""

from radixkv.kernels.cache_ops import copy_blocks, store_kv
from radixkv.kernels.paged_attention import AttentionLaunches, paged_attention, plan_paged_attention

__all__ = ["AttentionLaunches", "copy_blocks", "paged_attention", "plan_paged_attention", "store_kv"]
