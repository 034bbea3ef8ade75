"""The routing decision (`route`), the per-replica prefix index, and the router's bookkeeping."""

import random

import pytest

from radixkv.router import (
    NoReplicaAvailable,
    PrefixIndex,
    ReplicaView,
    Router,
    RouterConfig,
    route,
)

V = ReplicaView


def test_longest_match_wins_when_it_covers_enough_of_the_prompt():
    views = [V(0, 0), V(60, 3), V(20, 0)]
    d = route("cache-aware", 100, views, turn=0)
    assert (d.replica, d.reason, d.matched_tokens) == (1, "prefix", 60)


def test_a_short_match_goes_to_the_least_loaded_instead():
    config = RouterConfig(min_match_share=0.5)
    d = route("cache-aware", 100, [V(49, 0), V(0, 2), V(10, 1)], turn=0, config=config)
    assert (d.replica, d.reason) == (0, "no-match")
    d = route("cache-aware", 100, [V(49, 3), V(0, 2), V(10, 1)], turn=0, config=config)
    assert (d.replica, d.reason) == (2, "no-match")


def test_equal_matches_go_to_the_lower_load_then_rotate_with_the_turn():
    views = [V(50, 2), V(50, 1), V(50, 1), V(10, 0)]
    picks = {route("cache-aware", 60, views, turn=t).replica for t in range(4)}
    assert picks == {1, 2}
    idle = [V(0, 0)] * 3
    assert [route("least-load", 10, idle, turn=t).replica for t in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [route("cache-aware", 10, idle, turn=t).replica for t in range(3)] == [0, 1, 2]


def test_skewed_load_falls_back_to_the_least_loaded_replica():
    config = RouterConfig(min_match_share=0.1, balance_abs=4, balance_rel=1.5)
    # replica 0 holds the whole prompt but has 10 in flight against 2: past both thresholds
    d = route("cache-aware", 100, [V(100, 10), V(0, 2), V(0, 3)], turn=0, config=config)
    assert (d.replica, d.reason) == (1, "skew")
    # a gap past the absolute threshold but under the relative one is not skew
    d = route("cache-aware", 100, [V(100, 30), V(0, 25)], turn=0, config=config)
    assert (d.replica, d.reason) == (0, "prefix")
    # nor is a large ratio of small loads (under the absolute threshold)
    d = route("cache-aware", 100, [V(100, 4), V(0, 0)], turn=0, config=config)
    assert (d.replica, d.reason) == (0, "prefix")


def test_dead_replicas_are_never_chosen():
    views = [V(100, 0, alive=False), V(0, 5), V(0, 1, alive=False), V(0, 7)]
    assert route("cache-aware", 100, views, turn=0).replica == 1
    assert [route("round-robin", 1, views, turn=t).replica for t in range(4)] == [1, 3, 1, 3]
    assert route("least-load", 1, views, turn=0).replica == 1
    with pytest.raises(NoReplicaAvailable, match="no replica is alive"):
        route("round-robin", 1, [V(0, 0, alive=False)], turn=0)


def test_bad_router_name_and_thresholds_are_refused():
    with pytest.raises(ValueError, match="router must be one of cache-aware, round-robin, least-load"):
        route("random", 1, [V(0, 0)], turn=0)
    with pytest.raises(ValueError, match="balance_rel"):
        RouterConfig(balance_rel=0.5)
    with pytest.raises(ValueError, match="min_match_share"):
        RouterConfig(min_match_share=2)


def test_prefix_index_ages_out_the_least_recently_routed_prompts():
    index = PrefixIndex(capacity_blocks=8, block_size=4)
    a, b, c = list(range(0, 16)), list(range(100, 116)), list(range(200, 216))  # 4 blocks each
    index.record(a)
    index.record(b)
    assert index.match(a + [7, 7]) == 16 and index.match(b) == 16
    index.record(a)  # a is used again: b is now the least recently used
    index.record(c)  # c's 4 blocks evict b's 4
    index.check_invariants()
    assert index.num_cached_blocks == 8
    assert (index.match(a), index.match(b), index.match(c)) == (16, 0, 16)
    index.clear()
    assert index.match(c) == 0


def test_prefix_index_matches_a_naive_lru_of_routed_sequences():
    """Random runs against a dictionary of block prefixes with their last use: after every
    record, each sequence's match equals the naive leading run of cached block prefixes."""
    rng = random.Random(5)
    B, capacity = 2, 24
    index = PrefixIndex(capacity, B)
    naive: dict[tuple[int, ...], int] = {}  # block-aligned prefix -> last use
    pool = [[rng.randrange(3) * 100 + rng.randrange(2) * 10 + k for k in range(2 * rng.randint(1, 6))]]
    for clock in range(300):
        base = rng.choice(pool)
        seq = base[: 2 * rng.randint(0, len(base) // 2)] + [1000 + 2 * clock + k for k in range(2)]
        pool.append(seq)
        prefixes = [tuple(seq[: B * (k + 1)]) for k in range(len(seq) // B)]
        for p in prefixes:
            naive[p] = clock
        while len(naive) > capacity:  # oldest first, longest first among equals
            del naive[min(naive, key=lambda p: (naive[p], -len(p)))]
        index.record(seq)
        index.check_invariants()
        for probe in rng.sample(pool, min(5, len(pool))):
            k = 0
            while k < len(probe) // B and tuple(probe[: B * (k + 1)]) in naive:
                k += 1
            assert index.match(probe) == k * B, f"step {clock}: {probe}"


def test_router_counts_load_skips_a_dead_replica_and_forgets_a_restarted_one():
    router = Router("cache-aware", 2, capacity_blocks=64, block_size=4)
    prompt = list(range(40))
    first = router.choose(prompt)
    router.dispatch(first, prompt)
    again = router.choose(prompt + [99])
    assert (again.replica, again.reason, again.matched_tokens) == (first.replica, "prefix", 40)
    assert router.stats[first.replica].load == 1
    router.set_alive(first.replica, False)
    assert router.choose(prompt).replica != first.replica
    router.complete(first.replica)  # its request ended (failed) while it was out
    assert router.stats[first.replica].load == 0
    router.set_alive(first.replica, True)
    assert router.choose(prompt).replica == first.replica  # a pause, not a restart: index kept
    router.restarted(first.replica)
    assert router.choose(prompt).matched_tokens == 0
    assert router.stats[first.replica].estimated_hit_tokens == 0
