"""KV groups: the layers that share one block table, so that sliding layers can drop old blocks.

A sliding layer never reads keys older than its window, so once a block has left the window of
every token still to come, the sliding layers can free it while the global layers keep it. Each
layer is put in a group of layers with the same window, and each sequence keeps one block table
per group. All groups draw from one block pool of pages of equal size: a page holds the K/V of
`layers_per_group` layers for `block_size` tokens, and layer `l` keeps its K/V in page slot
`slot[l]` of the pages its group's table lists. Groups are as large as the smallest window class
(the global layers, as a rule: Gemma 3's 1 global to 5 sliding layers makes six groups of one
layer); a class that does not fill its last group leaves slots unused there.

Group 0 is the first global class (or, without global layers, the largest window) and never
frees a block: the radix tree's residency and eviction follow it. The others are sliding groups
with their `windows[g]`. A model with one window class has one group: the layout and every
book of the cache are then those of a model without groups. So has any model with
`split=False`: every layer keeps every block (the kernel still masks each layer's window), for
what moves whole blocks of every layer at once (a host tier, a KV store, tensor-parallel ranks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroups:
    """`group[l]` and `slot[l]`: layer l's group and its slot in that group's pages;
    `windows[g]`: group g's window (None for group 0 when the model has global layers)."""

    group: tuple[int, ...]
    slot: tuple[int, ...]
    windows: tuple[int | None, ...]
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def sliding(self) -> tuple[int, ...]:
        """The windows of groups 1.. (those that free blocks), in group order."""
        return tuple(w for w in self.windows[1:] if w is not None)


def kv_groups(layer_windows: tuple[int | None, ...], split: bool = True) -> KVGroups:
    """The groups of a model whose layer `l` has sliding window `layer_windows[l]`; one group of
    every layer when `split` is False."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    classes: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        classes.setdefault(window, []).append(layer)
    # group 0 first: the global class, else the largest window; then the rest, largest first
    order = sorted(classes, key=lambda w: (w is not None, -(w or 0)))
    if len(order) == 1 or not split:
        n = len(layer_windows)
        return KVGroups((0,) * n, tuple(range(n)), (order[0],), n)
    size = min(len(layers) for layers in classes.values())
    group = [0] * len(layer_windows)
    slot = [0] * len(layer_windows)
    windows: list[int | None] = []
    for window in order:
        layers = classes[window]
        for i in range(0, len(layers), size):
            g = len(windows)
            windows.append(window)
            for j, layer in enumerate(layers[i : i + size]):
                group[layer], slot[layer] = g, j
    return KVGroups(tuple(group), tuple(slot), tuple(windows), size)


def sliding_keep_from(num_tokens: int, window: int, block_size: int) -> int:
    """The first block a sliding group needs once `num_tokens` tokens are computed: the tokens to
    come (positions >= num_tokens) see keys from position num_tokens + 1 - window on, so blocks
    wholly before num_tokens - window can go (one token of slack kept)."""
    return max(0, num_tokens - window) // block_size


def valid_match_end(blocks: list[int], null: int, end: int, window: int, block_size: int) -> int:
    """The longest prefix, at most `end` tokens, whose window is wholly present in a sliding
    group's `blocks` (`null` where a block was freed): the match length that group allows."""
    m = end
    while m > 0:
        lo, hi = max(0, m - window) // block_size, (m - 1) // block_size
        last_null = next((i for i in range(hi, lo - 1, -1) if blocks[i] == null), None)
        if last_null is None:
            return m
        m = last_null * block_size  # the window must end before the freed block
    return 0
