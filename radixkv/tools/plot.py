"""The replay's picture: TTFT distributions side by side, and the hit rate over time.

matplotlib is an optional extra (`pip install radixkv[plot]`); nothing else imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from radixkv.tools.replay_result import TurnRecord

_LABELS = {"prefix_cache": "prefix cache on", "no_prefix_cache": "prefix cache off"}


def plot_replay(runs: dict[str, list[TurnRecord]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'radixkv[plot]'") from None
    fig, (cdf, hits) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, records in runs.items():
        ttft = np.sort([r.ttft_s for r in records])
        cdf.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=_LABELS.get(name, name))
    cdf.set_xlim(left=0)
    cdf.set_xlabel("time to first token (s)")
    cdf.set_ylabel("share of requests")
    cdf.set_title("TTFT distribution")
    cdf.grid(alpha=0.3)
    cdf.legend()
    records = sorted(runs["prefix_cache"], key=lambda r: r.due_s)
    cached = np.cumsum([r.cached_tokens for r in records])
    prompt = np.cumsum([r.prompt_tokens for r in records])
    hits.plot([r.due_s for r in records], cached / np.maximum(prompt, 1), label="cumulative")
    hits.scatter(
        [r.due_s for r in records],
        [r.cached_tokens / r.prompt_tokens for r in records],
        s=8,
        alpha=0.4,
        label="per request",
    )
    hits.set_ylim(0, 1.02)
    hits.set_xlabel("arrival (s from the start)")
    hits.set_ylabel("prompt tokens found in the cache")
    hits.set_title("prefix cache hit rate over time")
    hits.grid(alpha=0.3)
    hits.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
