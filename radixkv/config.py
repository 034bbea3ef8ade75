"""Engine configuration, validated when it is made."""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.cache.block_pool import check_block_size, parse_bytes
from radixkv.cache.eviction import POLICIES
from radixkv.cache.kv_cache_manager import PREEMPTION_MODES

SCHEDULING_POLICIES = ("lpm", "fcfs")
STORE_SCHEMES = ("file://", "redis://", "rediss://", "valkey://")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


@dataclass(slots=True)
class EngineConfig:
    """How to build and run an engine.

    `model` is a preset name (`tiny-llama`, the default, needs no download) or a local Hugging
    Face folder. `kv_cache_memory` is bytes or a size like `"512MiB"`; None takes a share of the
    free memory of the device (`radixkv.model.memory_profile.kv_cache_budget`: on CUDA what a
    profiling forward at `max_num_batched_tokens` leaves of `gpu_memory_utilization`). `dtype`
    `"auto"` is the checkpoint's on CUDA (bfloat16 when it records none) and float32 on the CPU.
    `gpu_memory_share` is the part of the device this engine owns when several share it
    (`serve --replicas` on fewer GPUs sets it): each then sizes its cache from its own part.
    `enforce_eager` turns off CUDA graphs for decode steps. `max_model_len` None takes the
    model's. `max_num_batched_tokens` is the per-step token budget: a longer prompt is prefilled
    in chunks. `scheduling` orders the waiting queue: `lpm` (longest cached prefix first, with
    aging so nothing starves) or `fcfs`. `device` None picks CUDA when present.
    `tensor_parallel_size` N > 1 splits the model over N ranks, one process and device each
    (`radixkv.model.parallel_runner`); `kv_cache_memory` and `host_kv_cache_memory` are then per
    rank.

    `kv_cache_dtype` is how the KV cache stores K and V: `auto` (the default) in the model's
    dtype; `int8` in one byte each, with a one-byte scale per token and KV head computed as the
    token is stored (no calibration; about half the bytes of bfloat16, a quarter of float32, so
    about twice or four times the blocks in `kv_cache_memory`); `fp8_e4m3` likewise as float8 (CUDA
    of compute capability 8.9 or later only). Cached and freshly computed tokens read the same
    stored values, so caching never changes what a prompt gives at one `kv_cache_dtype`
    (`radixkv.model.kv_layout`). Single-rank only.

    `host_kv_cache_memory` (bytes or a size; 0, the default, is off) puts a host tier behind the
    device cache: evicted blocks are written there (pinned memory on CUDA) and loaded back on a
    hit; `host_write_through` copies blocks there as soon as they are cached. `preemption_mode`
    `swap` (needs the host tier) moves a preempted request's KV to the host and back instead of
    recomputing it.

    `kv_store` (`file:///dir` or `redis://host:port/db`; None, the default, is off) puts a store
    behind both tiers that outlives the process and that replicas share: full blocks are
    written to it as they are cached, and a match that runs out in memory continues there
    (`radixkv.kvstore`). Single-rank only.

    `overlap` runs each step's forward on a worker thread while the host schedules and prepares
    the next step (`radixkv.engine.overlap`); None, the default, turns it on on CUDA and off on the CPU,
    where host and "device" share the same cores and a forward leaves no time to hide.
    Single-rank only.
    """

    model: str = "tiny-llama"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    enable_prefix_cache: bool = True
    eviction: str = "lru"
    scheduling: str = "lpm"
    seed: int = 0
    device: str | None = None
    gpu_memory_utilization: float = 0.9
    gpu_memory_share: float = 1.0
    enforce_eager: bool = False
    host_kv_cache_memory: int | str = 0
    host_write_through: bool = False
    preemption_mode: str = "recompute"
    tensor_parallel_size: int = 1
    kv_store: str | None = None
    overlap: bool | None = None

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.gpu_memory_share <= 1:
            raise ValueError(f"gpu_memory_share must be in (0, 1], got {self.gpu_memory_share}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int):
            raise ValueError(f"tensor_parallel_size must be an integer, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {self.eviction!r}")
        if self.scheduling not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}")
        host = parse_bytes(self.host_kv_cache_memory, "host_kv_cache_memory", allow_zero=True)
        if self.preemption_mode not in PREEMPTION_MODES:
            mode = self.preemption_mode
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        if host and not self.enable_prefix_cache:
            raise ValueError("host_kv_cache_memory needs enable_prefix_cache (the host tier is in the tree)")
        if self.preemption_mode == "swap" and not host:
            raise ValueError("preemption_mode 'swap' needs a host tier: set host_kv_cache_memory > 0")
        if self.kv_store is not None:
            if not isinstance(self.kv_store, str) or not self.kv_store.startswith(STORE_SCHEMES):
                url = self.kv_store
                raise ValueError(f"kv_store must be file://DIR or redis://host:port/db, got {url!r}")
            if not self.enable_prefix_cache:
                raise ValueError("kv_store needs enable_prefix_cache (stored blocks join the radix tree)")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_store takes tensor_parallel_size 1 (each rank holds its own heads)")
        if self.device is None:
            import torch  # here, so that reading a config does not load torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.overlap and self.tensor_parallel_size > 1:
            raise ValueError("overlap takes tensor_parallel_size 1 (the ranks step in lockstep)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            options = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {options}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size > 1:
            raise ValueError("kv_cache_dtype int8 / fp8_e4m3 takes tensor_parallel_size 1 for now")
        if self.kv_cache_dtype == "fp8_e4m3":
            from radixkv.model.kv_layout import check_fp8_device

            check_fp8_device(self.device)
        if self.overlap is None:
            self.overlap = self.device.startswith("cuda") and self.tensor_parallel_size == 1
