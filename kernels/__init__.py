"""Triton kernels of radixkv: paged attention over block tables, KV store and block copy.

Without a GPU, Triton runs in its interpreter. The interpreter is chosen when a kernel is
decorated, so the switch is made here, before anything imports triton: a user on a CPU machine
gets working kernels without setting anything. An explicit TRITON_INTERPRET is left alone.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from radixkv.kernels.cache_ops import copy_blocks, store_kv
from radixkv.kernels.paged_attention import paged_attention

__all__ = ["copy_blocks", "paged_attention", "store_kv"]
