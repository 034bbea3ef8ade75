"""The one-byte scale codes of a quantized KV cache against a plain-math model of the format:
code c stands for 2^(c // 8 - 20) * (1 + (c % 8) / 8), and a scale is stored as the least code
value at or above it (the largest code above 3,840)."""

import bisect
import math
import random

import torch

from radixkv.kernels.scale_code import MAX_CODE, MIN_EXPONENT, decode_scale, encode_scale

VALUES = [2.0 ** (MIN_EXPONENT + c // 8) * (1 + (c % 8) / 8) for c in range(MAX_CODE + 1)]


def model_code(scale: float) -> int:
    return min(bisect.bisect_left(VALUES, scale), MAX_CODE)


def test_every_code_decodes_to_its_value_and_encodes_back():
    codes = torch.arange(MAX_CODE + 1, dtype=torch.uint8)
    assert decode_scale(codes).tolist() == VALUES
    assert torch.equal(encode_scale(decode_scale(codes)), codes)


def test_scales_round_up_to_the_least_code_at_or_above_them():
    rng = random.Random(0)
    scales = [0.0, 1e-30, VALUES[0] / 2, VALUES[-1], VALUES[-1] * 1.01, 1e9, float(torch.finfo().max)]
    scales += [math.nextafter(v, math.inf) for v in VALUES] + [math.nextafter(v, 0.0) for v in VALUES[1:]]
    scales += [10 ** rng.uniform(-9, 5) for _ in range(5000)]
    x = torch.tensor(scales, dtype=torch.float32)
    got = encode_scale(x).tolist()
    assert got == [model_code(s) for s in x.tolist()]
    decoded = decode_scale(encode_scale(x))
    inside = (x >= VALUES[0]) & (x <= VALUES[-1])
    assert (decoded[inside] >= x[inside]).all() and (decoded[inside] <= 1.125 * x[inside]).all()
