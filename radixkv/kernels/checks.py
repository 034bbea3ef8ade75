"""Argument checks shared by the kernels: cheap (shapes, dtypes, devices only), since they run once
per layer per step. Contents (block ids, lengths, slots) are the caller's contract and are not read:
that would cost a device sync on a GPU.
"""

import torch

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANTIZED_DTYPES = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
"""Caches stored in 8 bits, each with the largest magnitude it stores: a token's head is stored as
round(x / scale), scale = max|x| / that magnitude, its own scale kept beside it (no calibration)."""
SCALE_DTYPES = (torch.uint8, torch.float16, torch.float32)  # uint8: one-byte codes (scale_code)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """CUDA tensors run compiled Triton, CPU tensors its interpreter; no other device runs Triton."""
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} must be on a CUDA device or the CPU (Triton's interpreter), got {t.device}")


def check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like the KV cache, got {t.device}")


def check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    any_dtype: bool = False,
) -> None:
    """k_cache and v_cache: [num_blocks, block_size, Hkv, D], one dtype, one layout, D contiguous.

    The kernels compute one set of row offsets for both caches, hence the same strides. A cache in
    float32, float16 or bfloat16 takes no scales; an int8 or float8_e4m3fn cache takes both,
    [num_blocks, block_size, Hkv] in uint8 (one-byte codes, radixkv.kernels.scale_code), float16
    or float32, one layout for the two. `any_dtype`: a cache only moved, never read as numbers
    (copy_blocks), may hold any dtype of 1 to 4 bytes.
    """
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    if any_dtype:
        if k_cache.element_size() not in (1, 2, 4):
            raise ValueError(f"k_cache elements must be 1, 2 or 4 bytes, got {k_cache.dtype}")
    elif k_scale is None and v_scale is None:
        if k_cache.dtype not in CACHE_DTYPES:
            raise ValueError(
                f"k_cache dtype must be float32, float16 or bfloat16 (int8 or float8_e4m3fn with "
                f"k_scale and v_scale), got {k_cache.dtype}"
            )
    else:
        _check_scales(k_cache, k_scale, v_scale)
    if k_cache.stride(3) != 1:
        raise ValueError("k_cache must be contiguous in its last (head size) dimension")
    _check_twin("v_cache", v_cache, "k_cache", k_cache)
    check_same_device("v_cache", v_cache, k_cache.device)


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """An int32/int64 index tensor of the given shape (-1 in shape: any size)."""
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != len(shape) or any(want not in (-1, got) for want, got in zip(shape, t.shape, strict=False)):
        want = ", ".join("*" if n == -1 else str(n) for n in shape)
        raise ValueError(f"{name} must have shape [{want}], got {tuple(t.shape)}")
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    check_same_device(name, t, device)


def _check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if k_cache.dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"k_scale and v_scale go with an int8 or float8_e4m3fn k_cache, got {k_cache.dtype}")
    if k_scale is None or v_scale is None:
        raise ValueError("a quantized k_cache needs both k_scale and v_scale")
    want = tuple(k_cache.shape[:3])
    if k_scale.shape != want or k_scale.dtype not in SCALE_DTYPES:
        raise ValueError(
            f"k_scale must be [num_blocks, block_size, Hkv] = {list(want)} in uint8 (scale codes), "
            f"float16 or float32, got {tuple(k_scale.shape)}, {k_scale.dtype}"
        )
    _check_twin("v_scale", v_scale, "k_scale", k_scale)
    check_same_device("k_scale", k_scale, k_cache.device)
    check_same_device("v_scale", v_scale, k_cache.device)


def _check_twin(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """`t` (a V tensor) has `like`'s (its K twin's) shape, strides and dtype: one kernel offset
    serves both."""
    if (t.shape, t.stride(), t.dtype) != (like.shape, like.stride(), like.dtype):
        raise ValueError(
            f"{name} must have {like_name}'s shape, strides and dtype {tuple(like.shape)}, "
            f"{like.stride()}, {like.dtype}; got {tuple(t.shape)}, {t.stride()}, {t.dtype}"
        )
