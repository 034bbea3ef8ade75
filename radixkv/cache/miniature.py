"""Miniature simulation: a few scaled-down caches over a sample of the blocks, one per eviction
setting the `adaptive` policy can take, run side by side on the live traffic.

Spatial sampling (Waldspurger et al., "Cache Modeling and Optimization using Miniature
Simulations", USENIX ATC 2017): a cache of `rate * capacity` blocks fed only the accesses to a
sampled `rate` of the blocks has about the hit rate of the full cache under the same policy,
since every access to a sampled block is seen and none of another's. Here the sample is of block
depths (position // block size), spaced evenly, rather than of hashed identities: every prompt
covers the depths from 0 to its length, so each one gives the sample its share of blocks and
the estimate's noise is that of a systematic sample, not of a coin per block. `rate` is
`SAMPLE_RATE` (a sixteenth: the work stays a fixed share of the traffic's), with at least
`MIN_SAMPLE_BLOCKS` blocks in each miniature (all of them, rate 1, for pools that small).

A sampled block is known by its tokens and position, as the radix tree keys blocks, so the
sample does not depend on how the live tree happens to cut its edges. Blocks that are not
full are left out (their tokens are not final).

Each miniature is independent of the live cache and of the others; each W-TinyLFU miniature
keeps its own frequency counts (`Counts`) of the blocks it is fed, so that a request's sampled
blocks run through one miniature at a time, each in a call of its own.
`Miniatures.scores` are the hits of each miniature, scaled down after every decision so that
they follow a changing workload; `Miniatures.decide` compares them, each corrected by how the
live cache fared against its miniature when it ran that setting (a setting not run yet is taken
at its miniature's word).
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left
from collections import OrderedDict
from typing import NamedTuple

import xxhash

SAMPLE_RATE = 1 / 16  # of the block depths
MIN_SAMPLE_BLOCKS = 64  # in each miniature, however small the pool
# Sampled accesses queued before the miniatures run them: a request brings a few, and a call
# into each miniature per request cost more than their caching.
BATCH_BLOCKS = 256
# How far a setting's score is scaled by the live cache's record with it: one period's record
# is noisy, so it may correct a miniature by 15% at most either way.
CALIBRATION = (0.85, 1.15)
DECAY = 0.7  # of the scores at each decision: the last three or so periods count
PROTECTED_SHARE = 0.8  # of a W-TinyLFU main area, as Caffeine keeps it
ATTENTION_TOKENS = 32768  # GDSF's recompute cost of a block: 1 + its position / this
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio
_MASK = (1 << 64) - 1
_HALF = 1 << 63


def gdsf_priority(inflation: float, hits: int, end: int, attention_tokens: int = ATTENTION_TOKENS) -> float:
    """GDSF's priority of a run of blocks ending at position `end` that was hit `hits` times:
    the inflation plus frequency times the cost of recomputing it, its MLP part (1) plus its
    attention over the context before it. The one formula `GDSF`, `adaptive` under GDSF, and
    the GDSF miniature rank by."""
    return inflation + (hits + 1) * (1.0 + end / attention_tokens)


class Setting(NamedTuple):
    """One setting `adaptive` can run in: W-TinyLFU with this window share (1.0 is LRU
    exactly), or GDSF (`window` None)."""

    name: str
    window: float | None


LRU_SETTING = Setting("lru", 1.0)
GDSF_SETTING = Setting("gdsf", None)
# The window shares that matter, from the evidence: about 1% where most blocks are used once
# (Caffeine's default too), LRU where recency is all there is, and GDSF where deep, often-used
# prefixes should outlive shallow ones; 20% bridges the two ends.
SETTINGS = (
    Setting("window 0.01", 0.01),
    Setting("window 0.2", 0.2),
    LRU_SETTING,
    GDSF_SETTING,
)


class Counts:
    """How often each sampled key was seen lately: exact counts, all halved (zeros dropped)
    after every `period` additions, as TinyLFU ages its sketch. At most `period` keys are added
    between halvings and a survivor was seen at least twice, so it never holds more than
    `1.5 * period` keys."""

    def __init__(self, period: int) -> None:
        self.period = period
        self.counts: dict[int, int] = {}
        self.additions = 0

    def add(self, key: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        self.additions += 1
        if self.additions >= self.period:
            self.counts = {k: c >> 1 for k, c in self.counts.items() if c > 1}
            self.additions = 0

    def get(self, key: int) -> int:
        return self.counts.get(key, 0)


Blocks = list[tuple[int, int]] | tuple[tuple[int, int], ...]  # (position, key), in access order


class MiniLRU:
    """LRU over blocks. Like each miniature, `run` takes a request's sampled blocks at once and
    returns how many it hit: the loop inside one call per request, not a call per block, keeps
    the miniatures a small share of the policy's cost."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, None] = OrderedDict()

    def run(self, blocks: Blocks) -> int:
        entries, capacity, hits = self.entries, self.capacity, 0
        for _, key in blocks:
            if key in entries:
                entries.move_to_end(key)
                hits += 1
                continue
            entries[key] = None
            if len(entries) > capacity:
                entries.popitem(last=False)
        return hits

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def held(self) -> int:
        return len(self.entries)

    @property
    def max_entries(self) -> int:
        return self.capacity


class MiniTinyLFU:
    """W-TinyLFU over blocks: an LRU window of `window * capacity` blocks, then a segmented LRU
    main area whose door a window's overflow passes only if seen more often than the block it
    would push out, by its own `counts` of the blocks it was fed (each W-TinyLFU miniature
    counts for itself, so that a batch's counts grow block by block as its accesses run)."""

    def __init__(self, capacity: int, window: float, counts: Counts) -> None:
        self.capacity = capacity
        self.window_size = max(1, round(window * capacity))
        self.main_size = capacity - self.window_size
        self.protected_size = int(PROTECTED_SHARE * self.main_size)
        self.counts = counts
        self.window: OrderedDict[int, None] = OrderedDict()
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()

    def run(self, blocks: Blocks) -> int:
        window, probation, protected, hits = self.window, self.probation, self.protected, 0
        add = self.counts.add
        for _, key in blocks:
            add(key)
            if key in window:
                window.move_to_end(key)
            elif key in protected:
                protected.move_to_end(key)
            elif key in probation:
                del probation[key]
                protected[key] = None
                if len(protected) > self.protected_size:
                    demoted, _ = protected.popitem(last=False)
                    probation[demoted] = None
            else:
                window[key] = None
                if len(window) > self.window_size:
                    self._admit(window.popitem(last=False)[0])
                continue
            hits += 1
        return hits

    def _admit(self, candidate: int) -> None:
        if len(self.probation) + len(self.protected) < self.main_size:
            self.probation[candidate] = None
            return
        if not self.main_size:
            return
        main = self.probation if self.probation else self.protected
        victim = next(iter(main))
        if self.counts.get(candidate) > self.counts.get(victim):
            del main[victim]
            self.probation[candidate] = None

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)

    @property
    def held(self) -> int:
        return len(self) + len(self.counts.counts)

    @property
    def max_entries(self) -> int:
        return self.capacity + int(1.5 * self.counts.period)  # `Counts`' own bound


class MiniGDSF:
    """GDSF over blocks, as `radixkv.cache.eviction.GDSF` ranks leaves: priority inflation plus
    (hits + 1) * recompute cost, the least first, the least recent among equals. A hit only
    raises the block's entry; the heap's copy, never above it, is brought up to date when it
    reaches the top (a popped copy that matches its entry is the true least)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.inflation = 0.0
        self.entries: dict[int, tuple[float, int, int]] = {}  # key -> (priority, stamp, hits)
        self.heap: list[tuple[float, int, int]] = []  # (priority, stamp, key), one per entry
        self.clock = 0

    def run(self, blocks: Blocks) -> int:
        entries, found = self.entries, 0
        for position, key in blocks:
            self.clock += 1
            entry = entries.get(key)
            hits = 0 if entry is None else entry[2] + 1
            priority = gdsf_priority(self.inflation, hits, position)
            entries[key] = (priority, self.clock, hits)
            if entry is not None:
                found += 1
                continue
            heapq.heappush(self.heap, (priority, self.clock, key))
            if len(entries) > self.capacity:
                self._evict()
        return found

    def _evict(self) -> None:
        heap, entries = self.heap, self.entries
        while True:
            priority, stamp, key = heap[0]
            current = entries[key]
            if current[1] == stamp:
                heapq.heappop(heap)
                del entries[key]
                self.inflation = max(self.inflation, priority)
                return
            heapq.heapreplace(heap, (current[0], current[1], key))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def held(self) -> int:
        return len(self.entries) + len(self.heap)

    @property
    def max_entries(self) -> int:
        return 2 * self.capacity  # the heap holds one copy per entry


class Miniatures:
    """One miniature cache per setting over the sampled blocks of a pool of `num_blocks`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        settings: tuple[Setting, ...] = SETTINGS,
        rate: float = SAMPLE_RATE,
    ) -> None:
        self.block_size = block_size
        self.settings = settings
        self.rate = min(1.0, max(rate, MIN_SAMPLE_BLOCKS / max(num_blocks, 1)))
        self.threshold = int(self.rate * (1 << 64))
        self._depths: list[int] = []  # the sampled block depths (position // block size), ascending
        self._depth_limit = 0  # depths below this are decided
        self.capacity = max(1, round(self.rate * num_blocks))
        self.count_period = 10 * self.capacity  # of each W-TinyLFU miniature's `Counts`
        self.caches = [self._make(s) for s in settings]
        self.scores = [0.0] * len(settings)  # each miniature's hits, scaled by DECAY each period
        self.accesses = 0  # sampled block accesses this period
        self._queued: list[tuple[int, int]] = []  # accesses the miniatures have not run yet
        self._period_hits = [0] * len(settings)
        self._live_hits = 0  # of this period's sampled accesses, those the live cache found
        self._live = [0.0] * len(settings)  # the live cache's hits while it ran a setting...
        self._mini = [0.0] * len(settings)  # ... and that setting's miniature's, over the same
        self._measured = [False] * len(settings)
        self._current, self._settled = -1, False

    def _make(self, setting: Setting) -> MiniLRU | MiniTinyLFU | MiniGDSF:
        if setting.window is None:
            return MiniGDSF(self.capacity)
        if setting.window >= 1.0:
            return MiniLRU(self.capacity)
        return MiniTinyLFU(self.capacity, setting.window, Counts(self.count_period))

    def sample(self, tokens: list[int], start: int, first: int = 0) -> tuple[tuple[int, int], ...]:
        """(position, key) of the sampled full blocks among `tokens` (an edge beginning at
        position `start`, a block multiple), from its `first` block on."""
        B = self.block_size
        base = start // B
        out = []
        for depth in self._depths_between(base + first, base + len(tokens) // B):
            at = (depth - base) * B
            data = array("q", tokens[at : at + B]).tobytes()
            out.append((depth * B, xxhash.xxh3_64_intdigest(data, seed=depth)))
        return tuple(out)

    def _depths_between(self, lo: int, hi: int) -> list[int]:
        """The sampled block depths in [lo, hi): depth d is in when the Weyl sequence 1/2 + d *
        golden ratio (mod 1) falls below `rate`, which spaces the sampled depths evenly and
        leaves out depth 0, the first block of every prompt and so the hottest, unless the rate
        is above one half; decided 4,096 depths at a time, as far as asked."""
        depths, threshold = self._depths, self.threshold
        while self._depth_limit < hi:
            start = self._depth_limit
            self._depth_limit += 4096
            new = range(start, self._depth_limit)
            depths += [d for d in new if (_HALF + d * _GOLDEN) & _MASK < threshold]
        return depths[bisect_left(depths, lo) : bisect_left(depths, hi)]

    def access(self, blocks: Blocks, live_hit: bool) -> None:
        """Every miniature sees each of `blocks` (position, key) accessed, in order; the live
        cache found them all (`live_hit`) or computed them all. The accesses queue until
        `BATCH_BLOCKS` of them wait or the period ends, then run through each miniature in one
        call: the miniatures see the same sequence, so they hit the same."""
        queued = self._queued
        queued += blocks
        if len(queued) >= BATCH_BLOCKS:
            self._run_queued()
        if live_hit:
            self._live_hits += len(blocks)
        self.accesses += len(blocks)

    def _run_queued(self) -> None:
        hits, queued = self._period_hits, self._queued
        for i, cache in enumerate(self.caches):
            hits[i] += cache.run(queued)
        queued.clear()

    def decide(self, current: int, margin: float) -> int:
        """Ends a period with `settings[current]` live; returns the setting to run next.

        A miniature ranks settings, but the live tree evicts whole leaves where a miniature
        evicts blocks, so for W-TinyLFU above all the two can part (on the Mooncake trace at
        4,000 blocks the miniature of the 1% window leads while the live cache at that window
        hits 15% less than LRU). So each setting's score is scaled by what the live cache
        achieved against that setting's miniature over the same sampled blocks, while it ran
        that setting, within `CALIBRATION` (the two periods after a switch are left out, the
        live cache holding what the previous setting kept). A setting the live cache has not
        run yet is taken at its miniature's word (scale 1). The best scaled score wins if it
        beats the current one's by more than `margin`, and a setting newly run is kept until
        its record is measured (three periods).

        Settings are run only when their score leads, not each once in turn: trying every
        setting in order cost up to 13 periods, most of a short trace at 16,000 blocks, and ran
        settings whose miniatures trailed all along (on the one-use workload of
        `--returns 0.1` at 16,000 blocks, LRU for three periods while its miniature was 7% behind).
        """
        self._run_queued()
        if current == self._current and self._settled:
            self._live[current] = DECAY * self._live[current] + self._live_hits
            self._mini[current] = DECAY * self._mini[current] + self._period_hits[current]
            self._measured[current] = True
        self._settled = current == self._current
        self._current = current
        self.scores = [DECAY * s + h for s, h in zip(self.scores, self._period_hits, strict=True)]
        self._period_hits = [0] * len(self.settings)
        self._live_hits = self.accesses = 0
        if not self._measured[current]:
            return current
        scaled = [s * self.calibration(i) for i, s in enumerate(self.scores)]
        best = max(range(len(scaled)), key=scaled.__getitem__)
        return best if scaled[best] > (1.0 + margin) * scaled[current] else current

    def calibration(self, i: int) -> float:
        """The live cache's hits per hit of setting `i`'s miniature while it ran `i`."""
        if self._mini[i] < 1.0:
            return 1.0
        low, high = CALIBRATION
        return min(high, max(low, self._live[i] / self._mini[i]))

    @property
    def max_entries(self) -> int:
        """What the miniatures can hold at most, in keys: each miniature's capacity (GDSF's
        twice, its heap beside its entries) and each W-TinyLFU miniature's counts (1.5 periods).
        With the default settings and rate, 35 keys per 16 blocks of the pool (about 2.2 a
        block), at least 2,240. Beside them waits the queue of accesses they have not run,
        fewer than `BATCH_BLOCKS` between calls."""
        return sum(c.max_entries for c in self.caches)
