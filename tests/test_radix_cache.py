"""Edge cases of the radix prefix cache, each checked against the cache's own invariants."""

import pytest

from radixkv.cache.block_pool import BlockPool
from radixkv.cache.eviction import LFU, make_policy
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.radix_tree import _common_len


def make(block_size: int, num_blocks: int = 64, policy=None) -> RadixCache:
    return RadixCache(BlockPool(num_blocks, block_size), policy)


def put(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Inserts `tokens` in fresh blocks as a finished sequence would, dropping its own refs."""
    blocks = cache.pool.allocate(-(-len(tokens) // cache.block_size))
    result = cache.insert(tokens, blocks)
    for b in blocks:
        cache.pool.decref(b)
    cache.check_invariants()
    return result.redundant


def test_empty_tree_matches_nothing():
    cache = make(4)
    m = cache.match_prefix([1, 2, 3])
    assert (m.num_tokens, m.blocks, m.node) == (0, [], cache.root)
    assert cache.evict(5) == 0
    assert cache.match_prefix([]).num_tokens == 0
    cache.check_invariants()


def test_exact_duplicate_insert_keeps_one_copy_and_reports_the_rest_redundant():
    cache = make(4)
    put(cache, list(range(10)))
    used = cache.pool.num_blocks - cache.pool.num_free
    blocks = cache.pool.allocate(3)
    result = cache.insert(list(range(10)), blocks)
    assert result.num_cached == 10
    assert result.redundant == blocks
    for b in blocks:
        cache.pool.decref(b)
    assert cache.pool.num_blocks - cache.pool.num_free == used
    cache.check_invariants()


def test_query_that_is_a_prefix_of_a_cached_key_matches_token_granular():
    cache = make(4)
    put(cache, list(range(12)))
    m = cache.match_prefix(list(range(6)))
    assert m.num_tokens == 6
    assert len(m.blocks) == 2  # one whole block and the partly matched second
    assert m.node.end == 4  # the lock covers the whole block only
    cache.check_invariants()


def test_key_that_extends_a_leaf_ending_inside_a_block_replaces_its_last_block():
    cache = make(4)
    put(cache, list(range(6)))  # blocks: [0..4) and a partial [4, 6)
    old_partial = cache.match_prefix(list(range(6))).blocks[1]
    blocks = cache.pool.allocate(3)
    result = cache.insert(list(range(11)), blocks)
    assert result.redundant == blocks[:1]  # the whole first block was cached already
    assert cache.pool.refcount(old_partial) == 0  # the fuller copy took the partial block's place
    assert cache.match_prefix(list(range(11))).blocks == [cache.match_prefix([0]).blocks[0], *blocks[1:]]
    for b in blocks:
        cache.pool.decref(b)
    assert cache.num_cached_blocks == 3
    assert len(cache.cached_sequences()) == 1
    assert cache.match_prefix(list(range(11)) + [99]).num_tokens == 11


def test_extension_of_a_short_leaf_rekeys_it():
    cache = make(8)
    put(cache, [5, 6])
    put(cache, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    m = cache.match_prefix([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])
    assert m.num_tokens == 10


def test_divergence_inside_a_block_copies_instead_of_recomputing():
    cache = make(8)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99])
    assert m.num_tokens == 10
    assert len(m.blocks) == 2 and m.node.end == 8
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99, 98])
    assert sorted(map(len, cache.cached_sequences())) == [12, 12]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99, 98, 0]).num_tokens == 12
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0]).num_tokens == 12
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 77]).num_tokens == 9


def test_divergence_in_the_first_block_of_a_child_is_found_by_the_partial_scan():
    cache = make(8)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m = cache.match_prefix([1, 2, 3, 0])
    assert m.num_tokens == 3
    assert m.node is cache.root and len(m.blocks) == 1


def test_split_keeps_every_block_in_exactly_one_node():
    cache = make(4)
    put(cache, list(range(16)))
    put(cache, [*range(8), 50, 51, 52, 53, 54])
    put(cache, [*range(4), 60])
    assert cache.num_cached_blocks == 4 + 2 + 1
    assert cache.match_prefix(list(range(16))).num_tokens == 16


@pytest.mark.parametrize("block_size", [1, 128])
def test_extreme_block_sizes(block_size):
    cache = make(block_size, num_blocks=1024)
    a = list(range(300))
    b = [*range(200), *range(1000, 1100)]
    put(cache, a)
    put(cache, b)
    assert cache.match_prefix(a).num_tokens == 300
    assert cache.match_prefix(b + [7]).num_tokens == 300
    assert cache.match_prefix([*range(250), 5]).num_tokens == 250
    used = cache.pool.num_blocks - cache.pool.num_free
    assert cache.evict(10**6) == used
    assert cache.pool.num_free == cache.pool.num_blocks
    cache.check_invariants()


def test_locked_paths_survive_eviction_and_sizes_stay_exact():
    cache = make(4)
    put(cache, list(range(16)))
    put(cache, [*range(8), 40, 41, 42, 43])
    m = cache.match_prefix(list(range(16)))
    cache.inc_lock(m.node)
    assert (cache.protected_size, cache.evictable_size) == (4, 1)
    cache.check_invariants()
    assert cache.evict(100) == 1  # asking for more than is evictable frees what it can
    assert cache.evictable_size == 0
    assert cache.match_prefix(list(range(16))).num_tokens == 16
    cache.dec_lock(m.node)
    assert (cache.protected_size, cache.evictable_size) == (0, 4)
    cache.check_invariants()
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock(m.node)


def test_lru_evicts_the_least_recently_used_leaf_first_from_its_tail():
    cache = make(4)
    put(cache, [1] * 12)
    put(cache, [2] * 12)
    cache.match_prefix([1] * 12)  # [1]* is now the more recent
    assert cache.evict(2) == 2
    assert cache.match_prefix([2] * 12).num_tokens == 4  # trimmed from the tail
    assert cache.match_prefix([1] * 12).num_tokens == 12
    cache.check_invariants()


def test_lfu_keeps_the_frequently_hit_prefix():
    cache = make(4, policy=LFU())
    put(cache, [1] * 8)
    put(cache, [2] * 8)
    for _ in range(3):
        cache.match_prefix([1] * 8)
    cache.match_prefix([2] * 8)  # more recent, but hit less often
    cache.evict(2)
    assert cache.match_prefix([1] * 8).num_tokens == 8
    assert cache.match_prefix([2] * 8).num_tokens == 0


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction must be one of"):
        make_policy("random")


def test_insert_needs_enough_blocks():
    cache = make(4)
    with pytest.raises(ValueError, match="need 3 blocks"):
        cache.insert(list(range(10)), [0, 1])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_the_common_length_is_the_first_mismatch_at_every_position_offset_and_limit(block_size):
    """`_common_len` compares in growing and shrinking slices: against a token-by-token count,
    with the mismatch at every position of a run longer than many doublings of a block."""
    n = 300
    for mismatch in [*range(n), n]:
        a = list(range(n))
        b = a[:mismatch] + [-1] * (n - mismatch)
        for i, j, limit in [(0, 0, None), (3, 3, None), (0, 0, 100), (5, 5, 7)]:
            m = min(n - i, n - j, limit if limit is not None else n)
            want = next((k for k in range(m) if a[i + k] != b[j + k]), m)
            assert _common_len(a, i, b, j, block_size, limit) == want, (mismatch, i, j, limit)
