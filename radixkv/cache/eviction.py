"""Which unreferenced cached leaf goes first when blocks run short.

A policy is a sort key over the radix tree's evictable leaves: the smallest key is evicted
first. The tree keeps the leaves in a `SortedList` under that key, so a leaf's key must not
change while it sits there: the tree takes a leaf out, updates its statistics (`last_access`, a
logical clock of matches and inserts; `hits`, how often it was on a matched path; `session`, the
chat session that last touched it), calls `touched`, and puts it back. A policy with state of its
own (GDSF's inflation) keeps it in `priority`, set in `touched`, and learns of each eviction
through `evicted`. Policies never change the tree; a policy that decides at eviction time
(`adaptive`) re-keys leaves only through the function the tree hands to `arrange`, and follows the
evictable set through `entered` and `left`.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import xxhash

from radixkv.cache.frequency_sketch import FrequencySketch
from radixkv.cache.miniature import (
    ATTENTION_TOKENS,
    PROTECTED_SHARE,
    SETTINGS,
    Miniatures,
    Setting,
    gdsf_priority,
)
from radixkv.errors import InvariantError

if TYPE_CHECKING:
    from sortedcontainers import SortedKeyList


class EvictableNode(Protocol):
    """What a policy sees of a radix tree node (`radixkv.cache.radix_cache.RadixNode`): its edge
    (`start`, `tokens`, `end`), its blocks, the statistics the tree keeps, and `priority`, the
    one field a policy writes. Policies are typed against this, not the tree, so the tree imports
    them and not the other way round."""

    start: int
    tokens: list[int]
    blocks: list[int]
    last_access: int
    hits: int
    session: str | None
    priority: Any

    @property
    def end(self) -> int: ...


Rekey = Callable[[EvictableNode, Callable[[EvictableNode], None]], None]


class EvictionPolicy:
    """The base of every policy: `key` is required, the hooks are optional."""

    name: str
    keys_blocks = False  # whether a leaf's key is its last block's own: then trim one at a time

    def key(self, node: EvictableNode) -> Any:
        """Sort key of an evictable leaf; the smallest is evicted first. It may read only what
        changes through `touched` (and `RadixCache.set_session_live`, which re-keys)."""
        raise NotImplementedError

    def touched(self, node: EvictableNode) -> None:
        """`node` was created, matched or extended; its statistics are already updated."""

    def evicted(self, node: EvictableNode) -> None:
        """The tree is about to evict blocks from the leaf `node`, the one `arrange` chose; it is
        out of the evictable leaves, so the policy may change its `priority` here (how what is
        left of it ranks if the eviction takes only part)."""

    def trimmed(self, node: EvictableNode) -> None:
        """Eviction cut blocks off the tail of the leaf `node`, which stays evictable."""

    def sized(self, num_blocks: int, block_size: int) -> None:
        """The cache's device pool: `num_blocks` blocks of `block_size` tokens."""

    def entered(self, node: EvictableNode) -> None:
        """`node` joined the evictable leaves (its key and blocks are fixed until it `left`)."""

    def left(self, node: EvictableNode) -> None:
        """`node` left the evictable leaves, as it was when it `entered`."""

    def arrange(self, leaves: SortedKeyList, rekey: Rekey) -> EvictableNode:
        """Before each eviction from `leaves` (sorted by key, never empty): returns the leaf to
        evict. The policy may re-key leaves first, `rekey(node, change)` with `change` setting
        what its key reads. The base policies' keys already put that leaf first."""
        return leaves[0]

    def check_leaves(self, leaves: SortedKeyList) -> None:
        """Asserts the policy's own books about the evictable leaves agree with a recount."""


class LRU(EvictionPolicy):
    """Least recently used first: the leaf whose last match or insert is oldest."""

    name = "lru"

    def key(self, node: EvictableNode) -> int:
        return node.last_access


class LFU(EvictionPolicy):
    """Least frequently used first, least recently used among equals."""

    name = "lfu"

    def key(self, node: EvictableNode) -> tuple[int, int]:
        return (node.hits, node.last_access)


class GDSF(EvictionPolicy):
    """Greedy-Dual-Size-Frequency: `priority = L + frequency * cost / size`, smallest first.

    `L` (inflation) is the priority of the last evicted leaf, so a leaf that was hot long ago
    ages out once newer leaves overtake it: plain LFU's weakness. Size is one block (eviction
    trims leaves block by block); the cost of a block is what recomputing it takes, its MLP part
    (1) plus its attention over the context before it (`end / attention_tokens`), so deep blocks
    of long prompts, the dearest to recompute, are kept a little longer. Ties go to recency.
    """

    name = "gdsf"

    def __init__(self, attention_tokens: int = ATTENTION_TOKENS) -> None:
        self.inflation = 0.0
        self.attention_tokens = attention_tokens

    def key(self, node: EvictableNode) -> tuple[float, int]:
        return (node.priority, node.last_access)

    def touched(self, node: EvictableNode) -> None:
        node.priority = gdsf_priority(self.inflation, node.hits, node.end, self.attention_tokens)

    def evicted(self, node: EvictableNode) -> None:
        self.inflation = max(self.inflation, node.priority)


class SessionAware(EvictionPolicy):
    """Blocks of live chat sessions outrank those of one-off requests and closed sessions.

    A leaf belongs to the session that last touched it. Among leaves of the same class (live, or
    not), the least recently used goes first, so a live session's blocks are not pinned forever:
    once only live sessions' leaves are left, they are evicted by recency too.
    """

    name = "session"

    def __init__(self) -> None:
        self.live: set[str] = set()

    def key(self, node: EvictableNode) -> tuple[bool, int]:
        return (node.session in self.live, node.last_access)


# `adaptive`'s segments, in eviction order: what a partial eviction left of a duel's loser,
# the main area, the window, the window's overflow waiting for its duel (which decides its fate
# whatever its rank), and every leaf while the policy runs as GDSF.
EVICT, PROBATION, PROTECTED, WINDOW, CANDIDATE, BY_GDSF = range(6)
SEGMENTS = BY_GDSF + 1


class _Entry(NamedTuple):
    """An `adaptive` node's standing, kept in `node.priority` (a split copies it to the upper
    half; the lower half, whose `start` moved, gets its own key when next seen)."""

    segment: int
    stamp: Any  # recency within the segment; under GDSF (priority, last access)
    hits: int  # node.hits when last seen: a larger count means an access since
    start: int  # node.start when last seen
    end: int  # node.end when last seen: less after a split or a trim, more after an extension
    key: int  # content key of the node's first block
    sampled: tuple[tuple[int, int], ...]  # the node's blocks in the miniatures' sample
    seen: int  # the tree's clock when the miniatures last saw the node hit (-2: not yet)


class Adaptive(EvictionPolicy):
    """W-TinyLFU over the tree's leaves, whose window share, or a switch to GDSF, is chosen by
    miniature simulation of each setting on the live traffic.

    W-TinyLFU: a new leaf enters an LRU window. When the window's leaf blocks exceed their share
    of the evictable leaves, its least recent leaves become candidates (a candidate hit while it
    waits moves to protected), and at each eviction the oldest candidate duels the main area's
    next victim (probation's least recent, else protected's): it is admitted to probation only
    if its estimated frequency beats the victim's, and the loser is evicted (`arrange` returns
    it, so a duel re-keys at most the one admitted). A probation leaf that is hit moves to
    protected; protected's overflow (past 80% of the main area) is demoted to probation. Without
    a duel pending, probation goes first, then protected, then the window. With the window at
    the whole cache this is LRU exactly; with a small one, blocks used once are turned away at
    the door and what is reused stays.

    Frequency is an aging count-min sketch (`FrequencySketch`: 4 rows of one-byte counters, each
    row the pool's block count rounded up to a power of two, so 4 to 8 bytes per cache block;
    halved every 10 x row width sightings) over block content keys: the tree's block hash (xxh3
    of the block's int64 tokens) seeded with the block's position. A node is keyed by its first
    block and counts one sighting each time a walk passes it whole, so a leaf's estimate is how
    often requests lately reached its run, kept across its eviction. When a split cuts a node,
    the lower half's first block takes the whole's count (it was used whenever the whole was).

    The controller (`radixkv.cache.miniature`): no single window is right everywhere. Where
    most blocks are used once a window of about 1% keeps 1.25-1.45x LRU's hits, where recency
    is all there is LRU wins, and on the Mooncake conversation trace GDSF beats both. So beside
    the live cache run miniatures of each setting (`SETTINGS`: windows of 1% and 20%, LRU,
    GDSF), each a sixteenth of the pool over a sixteenth of the block depths. After every
    `decide_every` sampled block accesses (a miniature-full by default: one pool-full of the
    traffic's blocks) the live cache moves to the setting whose miniature hit most lately, each
    miniature's score corrected by how the live cache fared against it when it ran that
    setting (`Miniatures.decide`; a setting not run yet at its miniature's word), if it beats
    the current one's by more than `MARGIN`. It starts at the 1% window (`window`), where the
    evidence puts large caches under one-use traffic, and keeps a setting it runs for the first
    time for three periods (two to settle, one to measure its correction): its first move, to
    the setting whose corrected score leads (if another does), comes after three periods, and
    a setting runs only when its score leads. A period is the pool's size over the blocks per
    request: on the shipped traces and workloads from 7 requests (docs at 1,000 blocks) to 750
    (chat at 16,000), so the first move comes after 21 to 2,250 requests; a later change of
    traffic is followed within about three periods (scores decay by `DECAY` each). Moving
    between windows is free (the window's overflow queues for its duels); moving to or from
    GDSF re-keys the evictable leaves once, O(n log n). `trajectory` keeps the last 4,096 (tree
    clock, setting) choices.

    Cost: keys are `(segment, stamp)`, so a segment's least recent leaf is a bisection of the
    tree's sorted leaves; a duel, a demotion and a touch are O(log n) plus an O(block size)
    hash; each sampled block (a sixteenth) costs one access in each miniature, O(1) (GDSF's
    O(log n)) and, when new, one hash. Memory beside the sketch is bounded by
    `Miniatures.max_entries`: about 2.2 keys per block of the pool.
    """

    name = "adaptive"
    TRAJECTORY = 4096
    MARGIN = 0.02

    def __init__(self, window: float = 0.01, adapt: bool = True, decide_every: int | None = None) -> None:
        if not 0.0 <= window <= 1.0:
            raise ValueError(f"window must be in [0, 1], got {window}")
        self.window_share = window
        self.adapt = adapt
        self.decide_every = decide_every
        self.sizes = [0] * SEGMENTS  # evictable leaf blocks per segment
        self.clock = 0
        self.block_size = self.num_blocks = 1
        self.sketch = FrequencySketch(64)
        self.inflation = 0.0  # GDSF's, while it runs as GDSF
        known = [s for s in SETTINGS if s.window == window]
        if adapt and not known:
            starts = [s.window for s in SETTINGS]
            raise ValueError(f"an adaptive window starts at one of {starts}, got {window}")
        self.setting = known[0] if known else Setting(f"window {window:g}", window)
        self.pending: Setting | None = None  # chosen, applied at the next `arrange`
        self.miniatures: Miniatures | None = None
        # Evictable leaves still ranked by the other side of a switch to or from GDSF: a switch
        # re-keys the evictable leaves, and a node locked or with children then is re-keyed
        # at the first eviction after it becomes one.
        self._stale: dict[int, EvictableNode] = {}
        self.trajectory: deque[tuple[int, str]] = deque(maxlen=self.TRAJECTORY)
        self._loser: EvictableNode | None = None  # the duel's loser `arrange` just chose

    def sized(self, num_blocks: int, block_size: int) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.sketch = FrequencySketch(1 << max(num_blocks - 1, 63).bit_length())
        if self.adapt:
            self.miniatures = Miniatures(num_blocks, block_size)
            if self.decide_every is None:
                self.decide_every = self.miniatures.capacity
        self.trajectory.append((self.clock, self.setting.name))

    @property
    def gdsf(self) -> bool:
        return self.setting.window is None

    def key(self, node: EvictableNode) -> tuple[int, Any]:
        entry = node.priority
        return (entry.segment, entry.stamp)

    def touched(self, node: EvictableNode) -> None:
        entry = node.priority
        self.clock = max(self.clock, node.last_access)
        minis = self.miniatures
        if not isinstance(entry, _Entry):  # a new leaf: its blocks were computed
            key = self._content_key(node)
            self.sketch.add(key)
            sampled = minis.sample(node.tokens, node.start) if minis is not None else ()
            self._accessed(sampled, False)
            node.priority = self._placed(node, WINDOW, node.last_access, key, sampled, -2)
            return
        key, sampled = entry.key, entry.sampled
        if node.start != entry.start:  # the lower half of a split: used whenever the whole was
            key = self._content_key(node)
            self.sketch.raise_to(key, self.sketch.estimate(entry.key))
            sampled = tuple(s for s in sampled if s[0] >= node.start)
        elif node.end < entry.end:  # the upper half of a split, or trimmed
            sampled = tuple(s for s in sampled if s[0] < node.end)
        elif node.end > entry.end and minis is not None:  # extended: the new blocks were computed
            grown = minis.sample(node.tokens, node.start, (entry.end - node.start) // self.block_size)
            self._accessed(grown, False)
            sampled += grown
        segment, stamp = entry.segment, entry.stamp
        seen = entry.seen
        if node.hits > entry.hits:
            self.sketch.add(key)
            if node.last_access > seen + 1:  # not the insert right after a request's match
                self._accessed(sampled, True)
            seen = node.last_access
            if segment != BY_GDSF:
                segment = WINDOW if segment == WINDOW else PROTECTED
                stamp = node.last_access
        node.priority = self._placed(node, segment, stamp, key, sampled, seen)

    def evicted(self, node: EvictableNode) -> None:
        entry = node.priority
        if entry.segment == BY_GDSF:
            self.inflation = max(self.inflation, entry.stamp[0])
        elif node is self._loser:  # what a partial eviction leaves of it goes on first
            node.priority = entry._replace(segment=EVICT)
        self._loser = None

    def entered(self, node: EvictableNode) -> None:
        self.sizes[node.priority.segment] += len(node.blocks)
        if (node.priority.segment == BY_GDSF) != self.gdsf:
            self._stale[id(node)] = node  # ranked under the setting before a switch

    def left(self, node: EvictableNode) -> None:
        self.sizes[node.priority.segment] -= len(node.blocks)
        self._stale.pop(id(node), None)

    def arrange(self, leaves: SortedKeyList, rekey: Rekey) -> EvictableNode:
        for node in list(self._stale.values()):
            rekey(node, self._rearranged)
        if self.sizes[EVICT]:
            return leaves[0]  # a duel's loser, partly evicted, goes on first
        if self.pending is not None:
            self._switch(leaves, rekey)
        if self.gdsf:
            return leaves[0]  # leaves are ranked by GDSF's priority
        total = sum(self.sizes)
        window_max = self.window_share * total
        protected_max = PROTECTED_SHARE * (total - window_max)
        while self.sizes[PROTECTED] > protected_max:
            rekey(self._first(leaves, PROTECTED), self._move_to(PROBATION))
        while self.sizes[WINDOW] > window_max:  # the window's overflow waits at the door
            rekey(self._first(leaves, WINDOW), self._move_to(CANDIDATE))
        while self.sizes[CANDIDATE]:
            candidate, victim = self._first(leaves, CANDIDATE), leaves[0]
            if victim.priority.segment not in (PROBATION, PROTECTED):
                rekey(candidate, self._move_to(PROBATION))  # the main area is empty: come in
                continue
            if self._frequency(candidate) > self._frequency(victim):
                rekey(candidate, self._move_to(PROBATION))  # newest in probation: the victim stays first
                self._loser = victim
            else:
                self._loser = candidate
            return self._loser
        return leaves[0]  # no duel: probation's least recent, else protected's, else the window's

    def check_leaves(self, leaves: SortedKeyList) -> None:
        sizes = [0] * SEGMENTS
        for node in leaves:
            sizes[node.priority.segment] += len(node.blocks)
            if (node.priority.segment == BY_GDSF) != self.gdsf and id(node) not in self._stale:
                raise InvariantError(f"a leaf in segment {node.priority.segment} under {self.setting.name}")
        if sizes != self.sizes:
            raise InvariantError(f"adaptive segment sizes {self.sizes}, recount {sizes}")
        if not 0.0 <= self.window_share <= 1.0:
            raise InvariantError(f"window share {self.window_share}")
        caches = self.miniatures.caches if self.miniatures is not None else []
        if any(len(c) > c.capacity or c.held > c.max_entries for c in caches):
            raise InvariantError(f"the miniatures outgrew their bound: {sum(c.held for c in caches)} keys")

    # ------------------------------------------------------------ internals

    def _placed(
        self, node: EvictableNode, segment: int, stamp: Any, key: int, sampled: tuple, seen: int
    ) -> _Entry:
        if self.gdsf:
            segment, stamp = BY_GDSF, (self._gdsf_priority(node), node.last_access)
        return _Entry(segment, stamp, node.hits, node.start, node.end, key, sampled, seen)

    def _gdsf_priority(self, node: EvictableNode) -> float:
        return gdsf_priority(self.inflation, node.hits, node.end)

    def _accessed(self, sampled: tuple[tuple[int, int], ...], hit: bool) -> None:
        """The miniatures see `sampled` accessed (found by the live cache if `hit`); after each
        period, the setting to run is chosen."""
        minis = self.miniatures
        if minis is None or not sampled:
            return
        minis.access(sampled, hit)
        if minis.accesses < self.decide_every:
            return
        best = minis.settings[minis.decide(minis.settings.index(self.setting), self.MARGIN)]
        self.pending = best if best != self.setting else None

    def _switch(self, leaves: SortedKeyList, rekey: Rekey) -> None:
        """Moves the live cache to the pending setting. Into GDSF or out of it, every evictable
        leaf is re-keyed (out of it, into probation by recency); between windows only the share
        moves."""
        was_gdsf, to = self.gdsf, self.pending
        self.setting, self.pending = to, None
        self.trajectory.append((self.clock, to.name))
        if to.window is not None:
            self.window_share = to.window
        if self.gdsf != was_gdsf:
            for node in list(leaves):
                rekey(node, self._rearranged)

    def _rearranged(self, node: EvictableNode) -> None:
        entry = node.priority
        if self.gdsf:
            node.priority = entry._replace(
                segment=BY_GDSF, stamp=(self._gdsf_priority(node), node.last_access)
            )
        else:
            node.priority = entry._replace(segment=PROBATION, stamp=node.last_access)

    def _first(self, leaves: SortedKeyList, segment: int) -> EvictableNode:
        """The least recent evictable leaf of `segment`, which holds some."""
        return leaves[leaves.bisect_key_left(((segment,),))]

    def _move_to(self, segment: int) -> Callable[[EvictableNode], None]:
        def move(node: EvictableNode) -> None:
            node.priority = node.priority._replace(segment=segment, stamp=self.clock)

        return move

    def _frequency(self, node: EvictableNode) -> int:
        entry = node.priority
        return self.sketch.estimate(entry.key if entry.start == node.start else self._content_key(node))

    def _content_key(self, node: EvictableNode) -> int:
        """The content key of `node`'s first block (partly filled or whole)."""
        head = array("q", node.tokens[: self.block_size]).tobytes()
        return xxhash.xxh3_64_intdigest(head, seed=node.start)


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU, GDSF, SessionAware, Adaptive)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {name!r}") from None
