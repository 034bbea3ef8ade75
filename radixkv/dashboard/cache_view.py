"""What the dashboard asks of an engine core in one call, in two halves.

`capture_view` runs where the cache lives (the core process, or the engine's own thread) between
two steps, under the step lock, so it reads a tree no step is editing: the metrics, the blocks by
tier and state, the eviction policy's state, and the tree's rows (`snapshot.capture_tree`), a few
milliseconds at most. `finish_view` runs in the caller, where no step waits for it: it builds the
tree snapshot from the rows (`snapshot.build_tree`). The server's `SnapshotCache` asks at most a
few times a second however many pages poll.
"""

from __future__ import annotations

from typing import Any

from radixkv.dashboard.snapshot import build_tree, capture_tree


def capture_view(core: Any, namespaces: list[int] | None) -> dict[str, Any]:
    """What `EngineCore.dashboard` returns (plain data, so it crosses a process pipe);
    `namespaces` as in `capture_tree`."""
    pool, cache = core.pool, core.kv.cache
    metrics = core.metrics()
    cached = cache.evictable_size if cache is not None else 0
    free = pool.num_free
    blocks = {"device": {"running": pool.num_blocks - free - cached, "cached": cached, "free": free}}
    host = cache.host if cache is not None else None
    if host is not None:
        held = host.pool.num_blocks - host.pool.num_free
        blocks["host"] = {"running": 0, "cached": held, "free": host.pool.num_free}
    if core.store is not None:
        blocks["store"] = {"running": 0, "cached": metrics.get("kv_store_written_blocks", 0), "free": 0}
    return {
        "metrics": metrics,
        "blocks": blocks,
        "block_size": pool.block_size,
        "policy": policy_state(cache.policy) if cache is not None else None,
        "tree": capture_tree(cache, namespaces) if cache is not None else None,
    }


def finish_view(captured: dict[str, Any]) -> dict[str, Any]:
    """The dashboard's view: `captured` with its tree rows built into the snapshot."""
    tree = captured["tree"]
    return {**captured, "tree": build_tree(tree) if tree is not None else None}


def policy_state(policy: Any) -> dict[str, Any]:
    """The eviction policy's name, and for `adaptive` its current setting and window share (None
    while it runs GDSF, which has no window)."""
    state: dict[str, Any] = {"name": getattr(policy, "name", type(policy).__name__.lower())}
    if hasattr(policy, "window_share"):
        state["window_share"] = policy.window_share if policy.setting.window is not None else None
        state["setting"] = policy.setting.name
    return state
