"""One-byte scales of a quantized KV cache: each token's head keeps its scale as a code of 8 bits.

A code is a small float, 5 exponent bits and 3 mantissa bits: code c stands for the float32 whose
bits are `(c + CODE_BIAS) << SHIFT`, from 2^-20 (code 0) to 1.875 * 2^11 = 3,840 (code 255), a
step of at most 12.5% between neighbours. A scale is stored as the code of the least value at or
above it (`encode_scale`): rounding up, so max|x| / scale never exceeds the largest value the
8-bit cache holds and nothing is clipped, at the cost of a quantization step up to 12.5% coarser
(about 0.1 bit). Scales under 2^-20 (a head of zeros) take code 0; over 3,840 (max|x| above
487,000 in int8), code 255.

Why one byte: at head size 32 (the tiny presets) a float16 scale is 2 bytes beside 32 of values,
so an int8 block is 64 / 34 = 1.88x smaller than bfloat16's; with a code it is 64 / 33 = 1.94x,
and 3.88x float32's. Encoding and decoding are integer operations on the float32 bits, exact on
every device: the Triton kernels compute the same codes and values as this reference.
"""

import torch

MANTISSA_BITS = 3
SHIFT = 23 - MANTISSA_BITS  # float32 mantissa bits a code drops
MIN_EXPONENT = -20  # code 0 is 2^MIN_EXPONENT
CODE_BIAS = (127 + MIN_EXPONENT) << MANTISSA_BITS  # the float32 bits >> SHIFT of code 0
MAX_CODE = 255
SCALE_CODE_DTYPE = torch.uint8


def encode_scale(scale: torch.Tensor) -> torch.Tensor:
    """The code (uint8) of the least code value >= `scale` (finite, >= 0), clamped to [0, 255]."""
    bits = scale.float().view(torch.int32).long()
    up = (bits + ((1 << SHIFT) - 1)) >> SHIFT
    return (up - CODE_BIAS).clamp(0, MAX_CODE).to(SCALE_CODE_DTYPE)


def decode_scale(code: torch.Tensor) -> torch.Tensor:
    """The float32 scale each code stands for."""
    return ((code.to(torch.int32) + CODE_BIAS) << SHIFT).view(torch.float32)
