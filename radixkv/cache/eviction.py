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
        """The tree is about to evict blocks from the leaf `node` (the one with the smallest key)."""

    def trimmed(self, node: EvictableNode) -> None:
        """Eviction cut blocks off the tail of the leaf `node`, which stays evictable."""

    def sized(self, num_blocks: int, block_size: int) -> None:
        """The cache's device pool: `num_blocks` blocks of `block_size` tokens."""

    def entered(self, node: EvictableNode) -> None:
        """`node` joined the evictable leaves (its key and blocks are fixed until it `left`)."""

    def left(self, node: EvictableNode) -> None:
        """`node` left the evictable leaves, as it was when it `entered`."""

    def arrange(self, leaves: SortedKeyList, rekey: Rekey) -> None:
        """Before each eviction from `leaves` (sorted by key): the policy may re-key leaves,
        `rekey(node, change)` with `change` setting what its key reads, so that the one it wants
        gone comes first. The base policies' keys already put it first."""

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

    def __init__(self, attention_tokens: int = 32768) -> None:
        self.inflation = 0.0
        self.attention_tokens = attention_tokens

    def key(self, node: EvictableNode) -> tuple[float, int]:
        return (node.priority, node.last_access)

    def touched(self, node: EvictableNode) -> None:
        cost = 1.0 + node.end / self.attention_tokens
        node.priority = self.inflation + (node.hits + 1) * cost

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


# `adaptive`'s segments, in eviction order: a duel's loser, the main area, the window, and the
# window's overflow waiting for its duel (which decides its fate whatever its rank).
EVICT, PROBATION, PROTECTED, WINDOW, CANDIDATE = range(5)


class _Entry(NamedTuple):
    """An `adaptive` node's standing, kept in `node.priority` (a split copies it to the upper
    half; the lower half, whose `start` moved, gets its own key when next seen)."""

    segment: int
    stamp: int  # recency within the segment
    hits: int  # node.hits when last seen: a larger count means an access since
    start: int  # node.start when last seen
    key: int  # content key of the node's first block


class Adaptive(EvictionPolicy):
    """W-TinyLFU over the tree's leaves: an LRU window for new blocks, a segmented LRU main area
    (probation, protected), and frequency-aware admission from the window to the main area.

    A new leaf enters the window. When the window's leaf blocks exceed their share of the
    evictable leaves, its least recent leaves become candidates, and at each eviction the oldest
    candidate duels the main area's next victim (probation's least recent, else protected's): it
    is admitted to probation only if its estimated frequency beats the victim's, and the loser is
    evicted. A probation leaf that is hit moves to protected; protected's overflow (past 80% of
    the main area) is demoted to probation. Without a duel pending, probation goes first, then
    protected, then the window. With the window at the whole cache this is LRU exactly (every
    leaf is in the window, ranked by its last access); with a small one, blocks used once are
    turned away at the door and what is reused stays.

    Frequency is an aging count-min sketch (`FrequencySketch`: 4 rows of one-byte counters, each
    row the pool's block count rounded up to a power of two, so 4 to 8 bytes per cache block;
    halved every 10 x row width sightings) over block content keys: the tree's block hash (xxh3
    of the block's int64 tokens) seeded with the block's position. A node is keyed by its first
    block and counts one sighting each time a walk passes it whole, so a leaf's estimate is how
    often requests lately reached its run, kept across its eviction: a document evicted and asked
    for again comes back with its history. When a split cuts a node, the lower half's first block
    takes the whole's count (it was used whenever the whole was). Two prefixes whose blocks at
    the same position hold the same tokens share counters: collisions only overestimate.

    The window's share adapts by ghost feedback, the rule ARC sizes its two lists by, rather than
    Caffeine's hill climbing: the last pool-size evicted leaves are remembered (first-block key
    only) with how they left, turned away at the door (a duel's losing candidate) or evicted
    from the main area or window otherwise. When a new leaf turns out to be one of them, that
    eviction was a mistake whose cost is the leaf's blocks: a rejected leaf returning means the
    window was too small to see its reuse, so the share grows by blocks / pool size; any other
    returning means the frequency-protected area was too small, so it shrinks by as much. Hill
    climbing compares hit rates of successive samples, which on prefix-cache traces (a few large
    requests per sample) is mostly noise: tried on the shipped traces with samples of 1 and 4
    pool sizes it wandered between 0.5 and 1.0 and gave up a third of admission's gain on
    one-off documents; ghost hits name the side that erred, one eviction at a time. The share
    starts at the whole cache, LRU, the safe side where recency is what matters. `trajectory`
    keeps the last 4,096 (ghost hits seen, share).

    Cost: keys are `(segment, stamp)`, so a segment's least recent leaf is a bisection of the
    tree's sorted leaves; a duel, a demotion and a touch are O(log n) plus an O(block size) hash;
    the ghosts are an insertion-ordered dict of at most pool-size keys.
    """

    name = "adaptive"
    PROTECTED_SHARE = 0.8
    TRAJECTORY = 4096

    def __init__(self, window: float = 1.0, adapt: bool = True) -> None:
        if not 0.0 <= window <= 1.0:
            raise ValueError(f"window must be in [0, 1], got {window}")
        self.window_share = window
        self.adapt = adapt
        self.sizes = [0] * 5  # evictable leaf blocks per segment
        self.clock = 0
        self.block_size = self.num_blocks = 1
        self.sketch = FrequencySketch(64)
        self.ghosts: dict[int, bool] = {}  # first-block key of an evicted leaf -> turned away
        self.num_ghosts = [0, 0]  # evicted otherwise, turned away
        self.ghost_hits = 0
        self.trajectory: deque[tuple[int, float]] = deque(maxlen=self.TRAJECTORY)
        self._loser_rejected = False

    def sized(self, num_blocks: int, block_size: int) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        self.sketch = FrequencySketch(1 << max(num_blocks - 1, 63).bit_length())

    def key(self, node: EvictableNode) -> tuple[int, int]:
        entry = node.priority
        return (entry.segment, entry.stamp)

    def touched(self, node: EvictableNode) -> None:
        entry = node.priority
        self.clock = max(self.clock, node.last_access)
        if not isinstance(entry, _Entry):  # a new leaf: its blocks were computed
            key = self._content_key(node)
            self.sketch.add(key)
            self._returned(node, key)
            node.priority = _Entry(WINDOW, node.last_access, node.hits, node.start, key)
            return
        key = entry.key
        if node.start != entry.start:  # the lower half of a split: used whenever the whole was
            key = self._content_key(node)
            self.sketch.raise_to(key, self.sketch.estimate(entry.key))
        segment, stamp = entry.segment, entry.stamp
        if node.hits > entry.hits:
            self.sketch.add(key)
            segment = WINDOW if segment == WINDOW else PROTECTED
            stamp = node.last_access
        node.priority = _Entry(segment, stamp, node.hits, node.start, key)

    def evicted(self, node: EvictableNode) -> None:
        key = node.priority.key if node.priority.start == node.start else self._content_key(node)
        self._forget(key)
        rejected = node.priority.segment == EVICT and self._loser_rejected
        self.ghosts[key] = rejected
        self.num_ghosts[rejected] += 1
        if len(self.ghosts) > self.num_blocks:
            self._forget(next(iter(self.ghosts)))

    def entered(self, node: EvictableNode) -> None:
        self.sizes[node.priority.segment] += len(node.blocks)

    def left(self, node: EvictableNode) -> None:
        self.sizes[node.priority.segment] -= len(node.blocks)

    def arrange(self, leaves: SortedKeyList, rekey: Rekey) -> None:
        if self.sizes[EVICT]:
            return  # a duel's loser, partly evicted, goes on first
        total = sum(self.sizes)
        window_max = self.window_share * total
        protected_max = self.PROTECTED_SHARE * (total - window_max)
        while self.sizes[PROTECTED] > protected_max:
            rekey(self._first(leaves, PROTECTED), self._move_to(PROBATION))
        while self.sizes[WINDOW] > window_max:  # the window's overflow waits at the door
            rekey(self._first(leaves, WINDOW), self._move_to(CANDIDATE))
        while self.sizes[CANDIDATE]:
            candidate, victim = self._first(leaves, CANDIDATE), leaves[0]
            if victim.priority.segment not in (PROBATION, PROTECTED):
                rekey(candidate, self._move_to(PROBATION))  # the main area is empty: come in
                continue
            admit = self._frequency(candidate) > self._frequency(victim)
            if admit:
                rekey(candidate, self._move_to(PROBATION))
            self._loser_rejected = not admit
            rekey(victim if admit else candidate, self._move_to(EVICT))
            return
        # No duel: probation's least recent goes, else protected's, else the window's.

    def check_leaves(self, leaves: SortedKeyList) -> None:
        sizes = [0] * 5
        for node in leaves:
            sizes[node.priority.segment] += len(node.blocks)
        if sizes != self.sizes:
            raise InvariantError(f"adaptive segment sizes {self.sizes}, recount {sizes}")
        if not 0.0 <= self.window_share <= 1.0:
            raise InvariantError(f"window share {self.window_share}")
        if len(self.ghosts) > self.num_blocks:
            raise InvariantError("the ghosts outgrew the pool")
        if self.num_ghosts[True] != sum(self.ghosts.values()):
            raise InvariantError("ghosts miscounted")
        if sum(self.num_ghosts) != len(self.ghosts):
            raise InvariantError("ghosts miscounted")

    # ------------------------------------------------------------ internals

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

    def _returned(self, node: EvictableNode, key: int) -> None:
        """A new leaf that was evicted lately moves the window toward the side that erred, by
        its blocks times the ratio of the other side's ghosts to its own (ARC's balance)."""
        rejected = self._forget(key)
        if rejected is None or not self.adapt:
            return
        ratio = max(1.0, self.num_ghosts[not rejected] / max(1, self.num_ghosts[rejected]))
        step = ratio * len(node.blocks) / self.num_blocks
        self.window_share = min(1.0, max(0.0, self.window_share + (step if rejected else -step)))
        self.ghost_hits += 1
        self.trajectory.append((self.ghost_hits, self.window_share))

    def _forget(self, key: int) -> bool | None:
        rejected = self.ghosts.pop(key, None)
        if rejected is not None:
            self.num_ghosts[rejected] -= 1
        return rejected


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU, GDSF, SessionAware, Adaptive)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction must be one of {sorted(POLICIES)}, got {name!r}") from None
