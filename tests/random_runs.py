"""How long the seeded random runs are: one environment variable scales them all.

`RADIXKV_RANDOM_RUNS` multiplies every random run's full length; its default, 0.1, keeps plain
`pytest` (the fast tier) quick, and CI's second step runs them whole with `RADIXKV_RANDOM_RUNS=1`
(more for a soak: `RADIXKV_RANDOM_RUNS=10 pytest tests/test_kv_cache_random.py`).
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("RADIXKV_RANDOM_RUNS", "0.1"))


def run_length(full: int, least: int = 1) -> int:
    """Steps of a run whose full length is `full`, and never fewer than `least` (what the run
    needs to reach the cases it asserts it reached)."""
    return max(least, round(full * SCALE))
