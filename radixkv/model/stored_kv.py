"""Device blocks as the KV store's bytes, and back; and the fingerprint of the model they belong to.

A stored block's payload is its K and V of every layer, `[2, layers, block_size, kv_heads,
head_dim]`, in the cache dtype, C order: the block dimension of the cache taken out
(`radixkv.kvstore.keys.LAYOUT_VERSION` names this layout). Saving gathers the blocks and copies
them to the host in the step (one copy, as an offload does); turning them into bytes happens
later, on the store's writer thread. A fetch is staged as a host-tier load is,
`[layers, 2, n, ...]` (pinned on CUDA), and written layer by layer during the forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xxhash

from radixkv.model.host_kv import BLOCK_DIM
from radixkv.model.loader import LoadedModel
from radixkv.model.presets import PRESETS


def model_fingerprint(loaded: LoadedModel, seed: int) -> str:
    """What the KV of a block depends on besides its tokens, dtype and block size: the model's
    name, its config, and its weights (a preset's seed, or a folder's weight files by name and
    size)."""
    config = json.dumps(loaded.config.to_dict(), sort_keys=True, default=str)
    if loaded.name in PRESETS:
        weights = f"seed={seed}"
    else:
        files = sorted(Path(loaded.name).glob("*.safetensors"))
        weights = ",".join(f"{f.name}:{f.stat().st_size}" for f in files)
    digest = xxhash.xxh3_128_hexdigest(f"{config}|{weights}".encode())
    return f"{Path(loaded.name).name}:{digest}"


def gather_blocks(kv_cache: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """A host copy of device blocks `blocks`, `[2, layers, n, ...]`: read now."""
    ids = torch.tensor(blocks, dtype=torch.long, device=kv_cache.device)
    return kv_cache.index_select(BLOCK_DIM, ids).to("cpu")


def block_payloads(rows: torch.Tensor) -> list[bytes]:
    """The payload of each block of `gather_blocks`' rows."""
    n = rows.shape[BLOCK_DIM]
    return [rows[:, :, i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(n)]


def stage_payloads(payloads: list[bytes], like: torch.Tensor) -> torch.Tensor:
    """Fetched payloads as a load's staged rows `[layers, 2, n, ...]` of the cache `like`
    (`[2, layers, blocks, ...]`), pinned on CUDA. Each payload is one block's exact size."""
    kv, layers, _, *slot = like.shape
    flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    blocks = flat.view(like.dtype).view(len(payloads), kv, layers, *slot)
    rows = blocks.permute(2, 1, 0, *range(3, 3 + len(slot))).contiguous()
    return rows.pin_memory() if like.device.type == "cuda" else rows
