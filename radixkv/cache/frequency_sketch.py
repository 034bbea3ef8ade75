"""An aging count-min sketch: how often a 64-bit key was seen lately, in fixed memory.

`depth` rows of `width` one-byte counters (`width` a power of two); a key's estimate is the least
of its counters, so collisions only ever raise it. Counters saturate at 15, as TinyLFU's 4-bit
ones do: frequency only has to rank a candidate against a victim, and a small ceiling lets
aging forget quickly. After `period` increments every counter is halved (TinyLFU's reset), so
what was hot long ago fades and the sketch follows a changing workload. Memory is
`depth * width` bytes and never grows; an increment or estimate is O(depth).
"""

from __future__ import annotations

MAX_COUNT = 15
_HALVE = bytes(b >> 1 for b in range(256))  # bytes.translate table: each counter halved, in C
_MASK = (1 << 64) - 1
# Odd 64-bit multipliers, one per row: multiplicative hashing spreads one key over the rows.
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


class FrequencySketch:
    def __init__(self, width: int, period: int | None = None, depth: int = 4) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width must be a power of two, got {width}")
        if not 1 <= depth <= len(_SEEDS):
            raise ValueError(f"depth must be in [1, {len(_SEEDS)}], got {depth}")
        self.width = width
        self.depth = depth
        self.period = period if period is not None else 10 * width
        self._shift = 64 - width.bit_length() + 1
        self._rows = [bytearray(width) for _ in range(depth)]
        self.additions = 0  # increments since the last halving

    @property
    def nbytes(self) -> int:
        return self.depth * self.width

    def _slots(self, key: int) -> list[int]:
        if self.width == 1:
            return [0] * self.depth
        return [((key * s) & _MASK) >> self._shift for s in _SEEDS[: self.depth]]

    def estimate(self, key: int) -> int:
        return min(row[i] for row, i in zip(self._rows, self._slots(key), strict=True))

    def add(self, key: int) -> None:
        """Counts one sighting of `key` (conservative update: only its smallest counters grow)."""
        slots = self._slots(key)
        least = min(row[i] for row, i in zip(self._rows, slots, strict=True))
        if least < MAX_COUNT:
            for row, i in zip(self._rows, slots, strict=True):
                if row[i] == least:
                    row[i] = least + 1
        self.additions += 1
        if self.additions >= self.period:
            self.age()

    def raise_to(self, key: int, count: int) -> None:
        """Makes `key`'s estimate at least `count` (a prefix is used at least as often as what
        extends it); counts as no sighting."""
        count = min(count, MAX_COUNT)
        for row, i in zip(self._rows, self._slots(key), strict=True):
            if row[i] < count:
                row[i] = count

    def age(self) -> None:
        """Halves every counter."""
        for k, row in enumerate(self._rows):
            self._rows[k] = bytearray(row.translate(_HALVE))
        self.additions = 0
