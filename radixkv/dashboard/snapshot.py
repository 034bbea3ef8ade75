"""The tree snapshot: a bounded, content-free picture of the radix cache for the dashboard.

A snapshot never carries token ids or text. A node is named by a keyed hash (BLAKE2b under a
secret drawn once per process) of its parent's name and its edge's tokens, so the same prefix
keeps its name from one snapshot to the next while nobody can test a guessed prompt against it.
What a node shows: its edge's token count, where it starts, its device and host blocks (hence its
tier), its lock count (the requests holding it), hits, how many cache ticks ago it was last used,
and a hash of the chat session that last touched it.

Bounded work: the walk visits at most `max_visit` nodes (breadth first, so the shared prefixes near
the root come first); a larger tree is marked `sampled` and what the walk did not reach is counted
from the cache's own block totals. Of the visited nodes at most `max_nodes` are kept, chosen best
first by the tokens under them, always with their ancestors, so the picture is one connected tree;
the children a kept node does not show are summed into one `other` entry of it.

Namespaces (`radixkv.cache.salt`): a salted request's tokens sit above `2**TOKEN_BITS`, so the
namespace of a root child is its first token shifted down. `namespaces`, when given, keeps only the
root children of those namespaces (the offsets `salt_offset` gives); everything else in the
snapshot (the per-namespace and per-session usage) is then counted over what is kept.
"""

from __future__ import annotations

import hashlib
import heapq
import secrets
from array import array
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from radixkv.cache.salt import TOKEN_BITS

MAX_NODES = 512
MAX_VISIT = 4096
_SECRET = secrets.token_bytes(16)  # names are stable within one process, unguessable outside it


def digest(data: bytes, size: int = 8) -> str:
    """A keyed hash of `data`, hex: the only form in which anything derived from content leaves."""
    return hashlib.blake2b(data, digest_size=size, key=_SECRET).hexdigest()


def namespace_of(first_token: int) -> int:
    """The salt offset (`salt_offset`) of the namespace a root child's first token lies in."""
    return (first_token >> TOKEN_BITS) << TOKEN_BITS


def tree_snapshot(
    cache: Any,
    namespaces: Iterable[int] | None = None,
    max_nodes: int = MAX_NODES,
    max_visit: int = MAX_VISIT,
) -> dict[str, Any]:
    """The snapshot of `cache` (a `RadixCache`) as a JSON-ready dict: `nodes` (the root first,
    each with `id`, `parent`, `tokens`, `start`, `blocks`, `host_blocks`, `tier`, `refs`, `hits`,
    `age`, `session`, and `subtree_tokens`), `sampled`, `visited`, `unvisited_blocks`, and
    `namespaces` / `sessions` (blocks per hashed namespace and per hashed session)."""
    allowed = None if namespaces is None else set(namespaces)
    root = cache.root
    order: list[Any] = []  # visited nodes, parents before children
    queue = deque([root])
    while queue and len(order) < max_visit:
        node = queue.popleft()
        order.append(node)
        for child in node.children.values():
            if node is root and allowed is not None and namespace_of(child.tokens[0]) not in allowed:
                continue
            queue.append(child)
    sampled = bool(queue)
    visited = set(map(id, order))
    below: dict[int, tuple[int, int]] = {}  # id(node) -> (tokens, blocks) in its visited subtree
    for node in reversed(order):
        inner = [below.get(id(c), (0, 0)) for c in node.children.values()]
        tokens, blocks = sum(t for t, _ in inner), sum(b for _, b in inner)
        below[id(node)] = (len(node.tokens) + tokens, len(node.blocks) + blocks)
    ns_of = {id(c): namespace_of(c.tokens[0]) for c in root.children.values()}
    kept = _choose(root, below, visited, max_nodes)
    names = {id(root): digest(b"root")}
    nodes, by_ns, by_session = [], Counter(), Counter()
    for node in order:
        if id(node) not in kept:
            continue
        if node is not root:
            edge = array("q", node.tokens).tobytes()
            names[id(node)] = digest(names[id(node.parent)].encode() + edge)
        nodes.append(_describe(cache, node, names, below))
        if node is not root:
            ns = ns_of.setdefault(id(node), ns_of.get(id(node.parent), 0))
            by_ns[digest(ns.to_bytes(8, "little"), 4) if ns else "unsalted"] += len(node.blocks)
            if node.session is not None:
                by_session[digest(node.session.encode(), 4)] += len(node.blocks)
        hidden = [c for c in node.children.values() if id(c) in visited and id(c) not in kept]
        if hidden:
            nodes.append(_other(names[id(node)], node, hidden, below))
    device_blocks = cache.evictable_size + cache.protected_size
    seen_blocks = sum(len(n.blocks) for n in order)
    return {
        "nodes": nodes,
        "sampled": sampled,
        "visited": len(order),
        "unvisited_blocks": max(0, device_blocks - seen_blocks) if sampled else 0,
        "namespaces": dict(by_ns.most_common(32)),
        "sessions": dict(by_session.most_common(32)),
    }


def _choose(root: Any, below: dict[int, tuple[int, int]], visited: set[int], max_nodes: int) -> set[int]:
    """Best first from the root by tokens under a node: each kept node's parent is kept."""
    kept: set[int] = set()
    heap = [(-below[id(root)][0], 0, root)]
    tie = 1
    while heap and len(kept) < max_nodes:
        _, _, node = heapq.heappop(heap)
        kept.add(id(node))
        for child in node.children.values():
            if id(child) in visited:
                heapq.heappush(heap, (-below[id(child)][0], tie, child))
                tie += 1
    return kept


def _describe(
    cache: Any, node: Any, names: dict[int, str], below: dict[int, tuple[int, int]]
) -> dict[str, Any]:
    device, host = len(node.blocks), len(node.host_blocks)
    return {
        "id": names[id(node)],
        "parent": names[id(node.parent)] if node.parent is not None else None,
        "tokens": len(node.tokens),
        "start": node.start,
        "subtree_tokens": below[id(node)][0],
        "blocks": device,
        "host_blocks": host,
        "tier": "device"
        if device and not host
        else "host"
        if host and not device
        else "device+host"
        if device
        else "none",
        "refs": node.lock_ref if node.parent is not None else 0,
        "hits": node.hits,
        "age": cache._clock - node.last_access,
        "session": digest(node.session.encode(), 4) if node.session is not None else None,
    }


def _other(
    parent_name: str, node: Any, hidden: list[Any], below: dict[int, tuple[int, int]]
) -> dict[str, Any]:
    tokens = sum(below[id(c)][0] for c in hidden)
    return {
        "id": parent_name + ":other",
        "parent": parent_name,
        "tokens": tokens,
        "start": node.end,
        "subtree_tokens": tokens,
        "blocks": sum(below[id(c)][1] for c in hidden),
        "host_blocks": sum(len(c.host_blocks) for c in hidden),
        "tier": "other",
        "refs": 0,
        "hits": sum(c.hits for c in hidden),
        "age": 0,
        "session": None,
        "other": len(hidden),
    }
