"""The host tier in the engine: KV evicted to host memory comes back bit for bit (outputs equal
transformers' and the first run's), swap preemption gives the outputs of an unpreempted run, the
metrics count the traffic, and bad sizes are clear errors.

Tiny llama, block size 4: 2 layers x 2 KV heads x 16 dims x 4 tokens x 2 (K and V) x 4 bytes is
2 KiB a block.
"""

from __future__ import annotations

import random

import pytest

from radixkv import BeamSearchParams, Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def engine(model_folders, device_kib: int, host_kib: int = 0, **kwargs) -> Engine:
    e = Engine.from_pretrained(
        model_folders["llama"],
        block_size=4,
        kv_cache_memory=f"{device_kib}KiB",
        host_kv_cache_memory=f"{host_kib}KiB",
        **kwargs,
    )
    e.step_hooks.append(Engine.check_invariants)
    return e


@pytest.mark.parametrize("write_through", [False, True])
def test_a_prompt_evicted_to_the_host_is_loaded_back_and_gives_the_same_tokens(
    model_folders, reference_models, write_through
):
    from test_engine import transformers_greedy

    a, b, c = prompts(3, seed=1, low=100, high=101)
    e = engine(model_folders, device_kib=96, host_kib=256, host_write_through=write_through)
    assert (e.pool.num_blocks, e.kv.cache.host.pool.num_blocks) == (48, 128)
    first = e.generate([a], GREEDY)[0]
    e.generate([b], GREEDY)
    e.generate([c], GREEDY)  # a's 27 blocks no longer fit beside b's and c's: a goes to the host
    assert e.kv.cache.cached_prefix_len(a) == len(a) and e.metrics()["num_offloaded_blocks"] >= 25
    again = e.generate([a], GREEDY)[0]
    m = e.metrics()
    assert again.num_cached_tokens == len(a) - 1
    assert m["host_cache_hits"] >= 96 and m["num_loaded_blocks"] >= 24
    assert again.token_ids == first.token_ids == transformers_greedy(reference_models["llama"], a, 8)
    assert m["num_host_blocks"] == 128 and 0 <= m["num_free_host_blocks"] < 128
    text = e.metrics_text()
    for name in ("host_cache_hits", "num_offloaded_blocks", "num_loaded_blocks", "num_swapped_out_blocks"):
        assert f"radixkv_{name}" in text


def run_all(e: Engine, batch: list[list[int]], params) -> list:
    if isinstance(params, BeamSearchParams):
        ids = [e.add_request(p, params) for p in batch]
        e.run_until(lambda: all(e.is_finished(i) for i in ids))
        return [[(b.token_ids, round(b.score, 5)) for b in e.beam_output(i)] for i in ids]
    return [[s.token_ids for s in out.samples] for out in e.generate(batch, params)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.8, n=3, seed=5, ignore_eos=True),
        BeamSearchParams(beam_width=3, max_tokens=12),
    ],
    ids=["greedy", "n=3", "beams"],
)
def test_swap_preemption_gives_the_outputs_of_an_unpreempted_run(model_folders, params):
    batch = prompts(6, seed=2, low=20, high=40)
    roomy = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    expected = run_all(roomy, batch, params)
    assert roomy.metrics()["num_preemptions"] == 0
    tight = engine(model_folders, device_kib=104, host_kib=512, preemption_mode="swap")
    assert run_all(tight, batch, params) == expected
    m = tight.metrics()
    assert m["num_preemptions"] > 0
    assert m["num_swapped_out_blocks"] > 0 and m["num_swapped_in_blocks"] > 0
    assert tight.runner.num_layered_loads > 0, "no swap-in was loaded layer by layer in a forward"
    assert tight.pool.num_free + tight.kv.cache.evictable_size == tight.pool.num_blocks, "blocks leaked"
    assert tight.kv.cache.protected_size == 0, "a swap lock was never released"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"host_kv_cache_memory": "lots"}, "host_kv_cache_memory must be bytes"),
        ({"host_kv_cache_memory": -1}, "host_kv_cache_memory must be >= 0"),
        ({"preemption_mode": "pause"}, "preemption_mode must be one of"),
        ({"preemption_mode": "swap"}, "needs a host tier"),
        ({"host_kv_cache_memory": "1MiB", "enable_prefix_cache": False}, "needs enable_prefix_cache"),
    ],
)
def test_bad_host_settings_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **fields)


def test_a_host_budget_below_one_block_is_refused(model_folders):
    with pytest.raises(ValueError, match="host_kv_cache_memory 100 holds no KV block"):
        Engine.from_pretrained(
            model_folders["llama"], block_size=4, kv_cache_memory="96KiB", host_kv_cache_memory=100
        )
