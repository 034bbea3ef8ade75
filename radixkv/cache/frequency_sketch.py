"""An aging count-min sketch: how often a 64-bit key was seen lately, in fixed memory.

Four rows of `width` one-byte counters (`width` a power of two); a key's estimate is the least
of its counters, so collisions only ever raise it. Counters saturate at 15, as TinyLFU's 4-bit
ones do: frequency only has to rank a candidate against a victim, and a small ceiling lets
aging forget quickly. After `period` increments every counter is halved (TinyLFU's reset), so
what was hot long ago fades and the sketch follows a changing workload. Memory is
`4 * width` bytes and never grows; an increment or estimate is O(1).
"""

from __future__ import annotations

MAX_COUNT = 15
_HALVE = bytes(b >> 1 for b in range(256))  # bytes.translate table: each counter halved, in C
_MASK = (1 << 64) - 1
# Odd 64-bit multipliers, one per row: multiplicative hashing spreads one key over the rows.
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


class FrequencySketch:
    """Four rows, as TinyLFU keeps them, laid end to end in one `bytearray`; a key's counter in
    row r is the top bits of its product with the row's multiplier. The rows are written out
    by hand, not looped over: a sketch touch is on every access of the `adaptive` policy, and
    the loop and its generators cost more than the counting."""

    depth = len(_SEEDS)

    def __init__(self, width: int, period: int | None = None) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width must be a power of two, got {width}")
        self.width = width
        self.period = period if period is not None else 10 * width
        self._shift = 64 - width.bit_length() + 1  # 64 for width 1: every key on counter 0
        self._counters = bytearray(self.depth * width)
        self.additions = 0  # increments since the last halving

    @property
    def nbytes(self) -> int:
        return len(self._counters)

    def _slots(self, key: int) -> tuple[int, int, int, int]:
        s0, s1, s2, s3 = _SEEDS
        shift, width = self._shift, self.width
        return (
            ((key * s0) & _MASK) >> shift,
            (((key * s1) & _MASK) >> shift) + width,
            (((key * s2) & _MASK) >> shift) + 2 * width,
            (((key * s3) & _MASK) >> shift) + 3 * width,
        )

    def estimate(self, key: int) -> int:
        c = self._counters
        a, b, d, e = self._slots(key)
        return min(c[a], c[b], c[d], c[e])

    def add(self, key: int) -> None:
        """Counts one sighting of `key` (conservative update: only its smallest counters grow)."""
        c = self._counters
        a, b, d, e = self._slots(key)
        least = min(c[a], c[b], c[d], c[e])
        if least < MAX_COUNT:
            grown = least + 1
            if c[a] == least:
                c[a] = grown
            if c[b] == least:
                c[b] = grown
            if c[d] == least:
                c[d] = grown
            if c[e] == least:
                c[e] = grown
        self.additions += 1
        if self.additions >= self.period:
            self.age()

    def raise_to(self, key: int, count: int) -> None:
        """Makes `key`'s estimate at least `count` (a prefix is used at least as often as what
        extends it); counts as no sighting."""
        count = min(count, MAX_COUNT)
        c = self._counters
        for i in self._slots(key):
            if c[i] < count:
                c[i] = count

    def age(self) -> None:
        """Halves every counter."""
        self._counters = bytearray(self._counters.translate(_HALVE))
        self.additions = 0
