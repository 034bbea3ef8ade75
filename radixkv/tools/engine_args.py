"""Command-line options shared by every command that builds an engine (serve, replay, chat), and
the `EngineConfig` they make. Defaults are `EngineConfig`'s own."""

from __future__ import annotations

import argparse

from radixkv.cache.eviction import POLICIES
from radixkv.cache.kv_cache_manager import PREEMPTION_MODES
from radixkv.config import SCHEDULING_POLICIES, EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser, *, prefix_cache_switch: bool = True) -> None:
    """The engine's options, as one group. `prefix_cache_switch=False` leaves out
    `--no-prefix-cache` for a command that decides that itself (replay's `--compare`)."""
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default="tiny-llama", help="preset name or local Hugging Face folder")
    engine.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto: the checkpoint's on CUDA, float32 on CPU",
    )
    engine.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--kv-cache-memory", default=None, help="e.g. 512MiB; default: part of free memory")
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8_e4m3"],
        help="auto: the model's dtype; int8: 1 byte per value with per-token, per-head scales; "
        "fp8_e4m3: likewise, CUDA compute capability 8.9+ only",
    )
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=128)
    engine.add_argument("--max-num-batched-tokens", type=int, default=4096)
    if prefix_cache_switch:
        engine.add_argument("--no-prefix-cache", action="store_true", help="switch the prefix cache off")
    else:
        parser.set_defaults(no_prefix_cache=False)
    engine.add_argument("--eviction", default="lru", choices=sorted(POLICIES))
    engine.add_argument("--scheduling", default="lpm", choices=list(SCHEDULING_POLICIES))
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="split the model over N ranks, a process each"
    )
    engine.add_argument(
        "--host-kv-cache-memory",
        default="0",
        help="a host tier behind the device cache, e.g. 4GiB (default 0: off)",
    )
    engine.add_argument("--host-write-through", action="store_true", help="copy blocks to the host as cached")
    engine.add_argument(
        "--preemption-mode", default="recompute", choices=PREEMPTION_MODES, help="swap needs the host tier"
    )
    engine.add_argument(
        "--kv-store",
        default=None,
        metavar="URL",
        help="a KV store behind the memory tiers that restarts and replicas share: file:///DIR[?max_bytes=N] "
        "or redis://HOST:PORT/DB",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of `add_engine_arguments`' options."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_cache=not args.no_prefix_cache,
        eviction=args.eviction,
        scheduling=args.scheduling,
        seed=args.seed,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        host_kv_cache_memory=args.host_kv_cache_memory,
        host_write_through=args.host_write_through,
        preemption_mode=args.preemption_mode,
        kv_store=args.kv_store,
    )
