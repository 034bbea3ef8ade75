"""The history ring: interval hit rates from the metrics' counters, and a fixed size."""

from radixkv.dashboard.history import History


def view(queries: int, hits: int) -> dict:
    device = {"running": 1, "cached": 2, "free": 3}
    return {
        "metrics": {"prefix_cache_queries": queries, "prefix_cache_hits": hits},
        "blocks": {"device": device},
        "policy": {"name": "adaptive", "window_share": 0.01},
    }


def test_history_takes_hit_rate_over_each_interval_and_keeps_only_the_last_samples():
    history = History(size=3)
    for queries, hits in [(100, 0), (200, 50), (200, 50), (400, 250)]:
        history.add(view(queries, hits))
    samples = history.as_list()
    assert len(samples) == 3
    assert [s["hit_rate"] for s in samples] == [0.5, None, 1.0]
    assert samples[-1]["hit_rate_total"] == 250 / 400 and samples[-1]["tokens_saved"] == 250
    assert samples[-1]["window_share"] == 0.01


def test_policy_state_names_the_policy_and_adaptive_its_window():
    from radixkv.cache.eviction import make_policy
    from radixkv.dashboard.cache_view import policy_state

    assert policy_state(make_policy("lru")) == {"name": "lru"}
    adaptive = make_policy("adaptive")
    state = policy_state(adaptive)
    assert state["name"] == "adaptive" and state["setting"] == adaptive.setting.name
    assert 0.0 < state["window_share"] <= 1.0
