"""The tree snapshot: a bounded, content-free picture of the radix cache for the dashboard.

Two phases, so that the step waits only for the first. `capture_tree` runs where the cache lives,
between two steps: a breadth-first walk (the shared prefixes near the root come first) of at most
`max_visit` nodes that copies a few numbers a node into flat rows; about 1 us a node, so a few
milliseconds at the bound. `build_tree` runs in the caller (the server's worker thread, across the
pipe from a core process): it sums subtrees, chooses what to show, names the nodes and counts the
usage, none of which any step waits for. A larger tree than the walk reaches is marked `sampled`,
and what the walk did not reach is counted from the cache's own block totals. Of the visited
nodes at most `max_nodes` are kept, chosen best first by the tokens under them, always with their
ancestors, so the picture is one connected tree; the children a kept node does not show are summed
into one `other` entry of it.

A snapshot never carries token ids or text. A node is named by a keyed hash (BLAKE2b under a secret
drawn once per process) of its parent's name and its child key in the tree (a hash of its first
block of tokens, distinct among siblings), so the same prefix keeps its name from one snapshot to
the next in one process while nobody can test a guessed prompt against it. What a node shows: its
edge's token count, where it starts, its device and host blocks (hence its tier), its lock count
(the requests holding it), hits, how many cache ticks ago it was last used, and a hash of the chat
session that last touched it.

Namespaces (`radixkv.cache.salt`): a salted request's tokens sit above `2**TOKEN_BITS`, so the
namespace of a root child is its first token shifted down. `namespaces`, when given, keeps only the
root children of those namespaces (the offsets `salt_offset` gives); everything else in the
snapshot (the per-namespace and per-session usage) is then counted over what is kept.
"""

from __future__ import annotations

import hashlib
import heapq
import secrets
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from radixkv.cache.salt import TOKEN_BITS

MAX_NODES = 512
MAX_VISIT = 4096
_SECRET = secrets.token_bytes(16)  # names are stable within one process, unguessable outside it


class Row(NamedTuple):
    """One visited node, as `capture_tree` copies it (the root is row 0, its parent -1)."""

    parent: int
    key: int  # the node's child key under its parent (0 for the root)
    namespace: int  # the salt offset its root child lies in (0: unsalted)
    tokens: int
    start: int
    blocks: int
    host_blocks: int
    refs: int
    hits: int
    age: int
    session: str | None


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
    """Both phases at once: `build_tree(capture_tree(cache, namespaces, max_visit), max_nodes)`."""
    return build_tree(capture_tree(cache, namespaces, max_visit), max_nodes)


def capture_tree(
    cache: Any, namespaces: Iterable[int] | None = None, max_visit: int = MAX_VISIT
) -> dict[str, Any]:
    """The first phase, under the step lock: `rows` (a `Row` tuple a visited node, parents before
    children), `sampled`, `filtered`, and the device blocks the cache holds (for what was not
    visited). The walk looks at most `max_visit` nodes, visited or passed over: a root child of
    another namespace counts too, so a root of many tenants' prompts costs no more."""
    allowed = None if namespaces is None else set(namespaces)
    root, clock = cache.root, cache._clock
    rows = [(-1, 0, 0, 0, 0, 0, 0, 0, root.hits, clock - root.last_access, None)]
    queue: deque[tuple[int, int, Any]] = deque()
    looked = 1  # nodes looked at, the root first

    def visit(parent: int, key: int, node: Any, namespace: int) -> None:
        queue.extend((len(rows), k, c) for k, c in node.children.items())
        rows.append(
            (
                parent,
                key,
                namespace,
                len(node.tokens),
                node.start,
                len(node.blocks),
                len(node.host_blocks),
                node.lock_ref,
                node.hits,
                clock - node.last_access,
                node.session,
            )
        )

    top = iter(root.children.items())  # the first level first, read lazily: a wide root is not copied
    for key, node in top:
        looked += 1
        namespace = namespace_of(node.tokens[0])
        if allowed is None or namespace in allowed:
            visit(0, key, node, namespace)
        if looked >= max_visit:
            break
    while queue and looked < max_visit:
        parent, key, node = queue.popleft()
        looked += 1
        visit(parent, key, node, rows[parent][2])
    sampled = bool(queue) or next(top, None) is not None
    return {
        "rows": rows,
        "sampled": sampled,
        "filtered": allowed is not None,
        "device_blocks": cache.evictable_size + cache.protected_size,
    }


def build_tree(captured: dict[str, Any], max_nodes: int = MAX_NODES) -> dict[str, Any]:
    """The second phase, anywhere: the snapshot as a JSON-ready dict: `nodes` (the root first,
    each with `id`, `parent`, `tokens`, `start`, `blocks`, `host_blocks`, `tier`, `refs`, `hits`,
    `age`, `session`, and `subtree_tokens`), at most `max_nodes` of them `other` entries included;
    `sampled`, `visited`, `unvisited_blocks` (None under a namespace filter, where the filtered
    part's total is not known without the walk), and `namespaces` / `sessions` (device blocks per
    hashed namespace and per hashed session, over every visited node).

    Queues of the breadth-first walk put whole levels before deeper ones, so queue order is a
    topological order: each row's parent comes before it."""
    rows = [Row(*r) for r in captured["rows"]]
    n = len(rows)
    children: list[list[int]] = [[] for _ in rows]
    for i, row in enumerate(rows[1:], 1):
        children[row.parent].append(i)
    tokens_below, blocks_below, host_below, hits_below = ([0] * n for _ in range(4))
    deepest = [row.start + row.tokens for row in rows]  # the furthest token position under a node
    by_ns, by_session = Counter(), Counter()
    for i in range(n - 1, -1, -1):  # children come after their parents
        row = rows[i]
        tokens_below[i] += row.tokens
        blocks_below[i] += row.blocks
        host_below[i] += row.host_blocks
        hits_below[i] += row.hits
        if i:
            p = row.parent
            tokens_below[p] += tokens_below[i]
            blocks_below[p] += blocks_below[i]
            host_below[p] += host_below[i]
            hits_below[p] += hits_below[i]
            deepest[p] = max(deepest[p], deepest[i])
            by_ns[digest(row.namespace.to_bytes(8, "little"), 4) if row.namespace else "unsalted"] += (
                row.blocks
            )
            if row.session is not None:
                by_session[digest(row.session.encode(), 4)] += row.blocks
    kept = _choose(children, [row.parent for row in rows], tokens_below, max_nodes)
    names = [""] * n
    names[0] = digest(b"root")
    nodes = []
    below = _Below(tokens_below, blocks_below, host_below, hits_below, deepest)
    for i, row in enumerate(rows):
        if i not in kept:
            continue
        if i:
            names[i] = digest(names[row.parent].encode() + row.key.to_bytes(8, "little"))
        nodes.append(_describe(row, names[i], names[row.parent] if i else None, tokens_below[i]))
        hidden = [c for c in children[i] if c not in kept]
        if hidden:
            nodes.append(_other(names[i], row, hidden, rows, below))
    sampled, filtered = captured["sampled"], captured["filtered"]
    unvisited = 0
    if sampled:
        unvisited = None if filtered else max(0, captured["device_blocks"] - blocks_below[0])
    return {
        "nodes": nodes,
        "sampled": sampled,
        "visited": n,
        "unvisited_blocks": unvisited,
        "namespaces": dict(by_ns.most_common(32)),
        "sessions": dict(by_session.most_common(32)),
    }


class _Below(NamedTuple):
    """Per row, over its subtree: tokens, device blocks, host blocks, hits, deepest position."""

    tokens: list[int]
    blocks: list[int]
    host: list[int]
    hits: list[int]
    deepest: list[int]


def _choose(
    children: list[list[int]], parent: list[int], tokens_below: list[int], max_nodes: int
) -> set[int]:
    """Best first from the root by tokens under a node, each kept node's parent kept, while the
    entries shown (the kept nodes, and one `other` entry for each with a child not kept) stay
    within `max_nodes`."""
    kept = {0}
    unkept = [len(c) for c in children]  # children not kept yet, per row
    entries = 1 + (unkept[0] > 0)
    heap = [(-tokens_below[c], c) for c in children[0]]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        more = entries + 1 + (unkept[i] > 0) - (unkept[parent[i]] == 1)
        if more > max_nodes:
            break
        kept.add(i)
        entries = more
        unkept[parent[i]] -= 1
        for c in children[i]:
            heapq.heappush(heap, (-tokens_below[c], c))
    return kept


def _tier(device: int, host: int) -> str:
    if device and host:
        return "device+host"
    return "device" if device else "host" if host else "none"


def _describe(row: Row, name: str, parent: str | None, subtree_tokens: int) -> dict[str, Any]:
    return {
        "id": name,
        "parent": parent,
        "tokens": row.tokens,
        "start": row.start,
        "subtree_tokens": subtree_tokens,
        "blocks": row.blocks,
        "host_blocks": row.host_blocks,
        "tier": _tier(row.blocks, row.host_blocks),
        "refs": row.refs,
        "hits": row.hits,
        "age": row.age,
        "session": digest(row.session.encode(), 4) if row.session is not None else None,
    }


def _other(parent: str, row: Row, hidden: list[int], rows: list[Row], below: _Below) -> dict[str, Any]:
    """The hidden children of a kept node, with everything under them, as one entry: as long
    (`tokens`) as the deepest of them reaches, its share of the parent's band (`subtree_tokens`)
    their tokens together, their blocks and hits summed, the age of the most recent."""
    end = row.start + row.tokens
    return {
        "id": parent + ":other",
        "parent": parent,
        "tokens": max(below.deepest[c] for c in hidden) - end,
        "start": end,
        "subtree_tokens": sum(below.tokens[c] for c in hidden),
        "blocks": sum(below.blocks[c] for c in hidden),
        "host_blocks": sum(below.host[c] for c in hidden),
        "tier": "other",
        "refs": 0,
        "hits": sum(below.hits[c] for c in hidden),
        "age": min(rows[c].age for c in hidden),
        "session": None,
        "other": len(hidden),
    }
