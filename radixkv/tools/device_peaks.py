"""What a GPU can do at most: dense bfloat16 matrix FLOP/s and memory bandwidth, the denominators
of model FLOP utilization (MFU) and model bandwidth utilization (MBU).

Bandwidth comes from the device's properties (memory clock x bus width x 2, double data rate), as
`radixkv bench kernels` has always measured it. FLOP/s come from the vendor's dense (no sparsity)
bfloat16 figure for devices in `DENSE_BF16_TFLOPS`; for any other device they are measured: the
best of a few large bfloat16 matrix multiplies, which understates the true peak a little.
"""

from __future__ import annotations

import functools
import time

import torch

DENSE_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H800": 989.4,
    "GH200": 989.4,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.1,
    "L4": 121.0,
    "A10G": 70.0,
}
"""Dense bfloat16 tensor-core TFLOP/s by a substring of the device name, most specific first."""


def peak_bandwidth(device: torch.device) -> float:
    """Bytes per second the device's memory can move at most (from its properties)."""
    props = torch.cuda.get_device_properties(device)
    return 2 * props.memory_bus_width / 8 * props.memory_clock_rate * 1e3


@functools.cache
def peak_bf16_flops(device: torch.device) -> tuple[float, str]:
    """(FLOP/s, "table" or "measured"): the table's figure for a known device, else measured."""
    name = torch.cuda.get_device_name(device)
    for key, tflops in DENSE_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12, "table"
    return _measured_matmul_flops(device), "measured"


def _measured_matmul_flops(device: torch.device, n: int = 8192, calls: int = 10) -> float:
    a = torch.randn((n, n), dtype=torch.bfloat16, device=device)
    b = torch.randn((n, n), dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            a @ b
        torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * n**3 / best
