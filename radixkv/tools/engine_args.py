"""Command-line options shared by every command that builds an engine."""

from __future__ import annotations

import argparse
from typing import Any

from radixkv.cache.kv_cache_manager import PREEMPTION_MODES


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """The host-tier options of every command that builds an engine."""
    parser.add_argument(
        "--host-kv-cache-memory",
        default="0",
        help="a host tier behind the device cache, e.g. 4GiB (default 0: off)",
    )
    parser.add_argument("--host-write-through", action="store_true", help="copy blocks to the host as cached")
    parser.add_argument(
        "--preemption-mode", default="recompute", choices=PREEMPTION_MODES, help="swap needs the host tier"
    )


def host_config(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig` fields from `add_host_arguments`' options."""
    return {
        "host_kv_cache_memory": args.host_kv_cache_memory,
        "host_write_through": args.host_write_through,
        "preemption_mode": args.preemption_mode,
    }
