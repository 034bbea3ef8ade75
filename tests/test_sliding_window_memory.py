"""Sliding-window KV memory: a Gemma-3-shaped model (5 sliding layers per global one) holds, per
token of a long conversation, close to the analytic minimum (the global layers the whole context,
the sliding layers their window), and its outputs still equal transformers'.

The tiny preset's KV groups are six groups of one layer (`radixkv.cache.kv_groups`), so a block is
one layer's K/V for `block_size` tokens and the minimum for a context of L tokens is
ceil(L / B) blocks of the global layer plus ceil(W / B) for each sliding layer.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import no_leaks
from test_model_families import run_after_shared_prefix

from radixkv import Engine, EngineConfig, SamplingParams
from radixkv.cache.kv_groups import kv_groups
from radixkv.model import cuda_graphs
from radixkv.model.loader import layer_windows, load_model
from radixkv.model.presets import PRESETS, SLIDING_WINDOW
from radixkv.model.runner import kv_block_bytes

B = 4
W = SLIDING_WINDOW


def gemma3_engine(num_blocks: int, **config: object) -> Engine:
    """tiny-gemma3 on `num_blocks` blocks of one layer each, invariants checked every step."""
    loaded = load_model("tiny-gemma3", dtype="float32", device="cpu")
    groups = kv_groups(loaded.layer_windows)
    block = kv_block_bytes(groups.layers_per_group, B, loaded.num_kv_heads, loaded.head_dim, torch.float32)
    engine = Engine(
        EngineConfig(
            model="tiny-gemma3",
            dtype="float32",
            device="cpu",
            block_size=B,
            kv_cache_memory=block * num_blocks,
            **config,
        )
    )
    engine.step_hooks.append(Engine.check_invariants)
    return engine


def blocks_held(engine: Engine) -> int:
    """Blocks in use, but the manager's null block and the stale group blocks only the tree
    holds (cached still, but the first ones any allocation takes: free, as far as memory goes)."""
    return engine.pool.num_blocks - engine.pool.num_free - 1 - engine.kv.cache.num_stale


def minimum_blocks(context: int) -> int:
    windows = layer_windows(PRESETS["tiny-gemma3"]())
    return sum(-(-(context if w is None else min(w, context)) // B) for w in windows)


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def test_groups_of_gemma3_are_one_global_and_five_sliding() -> None:
    groups = kv_groups(layer_windows(PRESETS["tiny-gemma3"]()))
    assert groups.windows == (None,) + (W,) * 5 and groups.layers_per_group == 1
    assert groups.group == (1, 2, 3, 4, 5, 0) and groups.slot == (0,) * 6
    gemma2 = kv_groups(layer_windows(PRESETS["tiny-gemma2"]()))
    assert gemma2.windows == (None, W) and gemma2.group == (1, 0, 1, 0) and gemma2.slot == (0, 0, 1, 1)
    assert kv_groups((None,) * 4).num_groups == 1 and kv_groups((W,) * 4).num_groups == 1


@pytest.mark.slow
def test_a_long_conversation_holds_at_most_1_2x_the_minimum_and_equals_transformers() -> None:
    """Ten turns of 24 new tokens and 12 generated, past 12 windows in all: each turn hits the
    whole conversation before it, and after each turn past four windows the blocks held (by the
    tree: nothing runs then) are at most 1.2x the minimum for the cached context, against
    about 1 / (1/6 + 5/6 * W / L) of it when every layer kept the whole context. Every generated
    token equals transformers' greedy choice over the whole conversation (teacher-forced)."""
    rng = random.Random(0)
    engine = gemma3_engine(num_blocks=2048)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    conversation: list[int] = tokens(40, rng)
    generated: list[tuple[int, list[int]]] = []  # (position of the first, tokens)
    ratios = []
    for turn in range(10):
        out = engine.generate([conversation], params)[0]
        if turn:
            assert out.num_cached_tokens == len(conversation) - 24 - 1, "the turn missed its prefix"
        generated.append((len(conversation), out.token_ids))
        conversation = conversation + out.token_ids
        cached = len(conversation) - 1  # the last generated token is never computed
        if cached > 4 * W:
            ratios.append(blocks_held(engine) / minimum_blocks(cached))
        conversation = conversation + tokens(24, rng)
    assert ratios and max(ratios) <= 1.2, f"blocks held / minimum: {ratios}"
    whole = 6 * -(-cached // B)  # every layer the whole context, as before KV groups
    assert whole / minimum_blocks(cached) > 3.5  # what the groups saved at the last turn
    model = load_model("tiny-gemma3", dtype="float32", device="cpu").model
    with torch.no_grad():
        logits = model(torch.tensor([conversation])).logits[0]
    for start, ids in generated:
        assert ids == logits[start - 1 : start - 1 + len(ids)].argmax(-1).tolist()
    no_leaks(engine)


@pytest.mark.slow
def test_samples_past_the_window_with_prefix_hits_copy_on_write_and_preemption_equal_transformers() -> None:
    """Two ~200-token prompts sharing 120 tokens, two greedy samples each (forks: their shared
    partly filled block is copied on write), 48 tokens each, prefilled 64 tokens a step on a pool
    too small for both requests at once: the second hits the first's prefix (the window before
    the hit's end is held), one of them is preempted and recomputed from what the tree kept.
    Every sample equals transformers' greedy tokens (teacher-forced)."""
    rng = random.Random(3)
    shared = tokens(120, rng)
    prompts = [shared + tokens(80 + 7 * i, rng) for i in range(2)]
    params = SamplingParams(n=2, max_tokens=48, temperature=0.0, ignore_eos=True)
    engine = gemma3_engine(num_blocks=240, max_num_batched_tokens=64)
    outs = run_after_shared_prefix(engine, prompts, params, len(shared))
    metrics = engine.metrics()
    assert metrics["num_preemptions"] > 0 and metrics["num_cow_copies"] > 0
    assert outs[1].num_cached_tokens >= 120 - B
    model = load_model("tiny-gemma3", dtype="float32", device="cpu").model
    for prompt, out in zip(prompts, outs, strict=True):
        for sample in out.samples:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1 : -1]
            assert sample.token_ids == logits.argmax(-1).tolist()
    no_leaks(engine)


# --------------------------------------------- what moves whole blocks keeps one group


def one_group_engine(num_blocks: int, host_blocks: int = 0, **config: object) -> Engine:
    """tiny-gemma3 with a host tier or a KV store: one KV group, so `num_blocks` blocks of all six
    layers each (`host_blocks` of them on the host), invariants checked every step."""
    loaded = load_model("tiny-gemma3", dtype="float32", device="cpu")
    block = kv_block_bytes(loaded.num_layers, B, loaded.num_kv_heads, loaded.head_dim, torch.float32)
    engine = Engine(
        EngineConfig(
            model="tiny-gemma3",
            dtype="float32",
            device="cpu",
            block_size=B,
            kv_cache_memory=block * num_blocks,
            host_kv_cache_memory=block * host_blocks,
            **config,
        )
    )
    engine.step_hooks.append(Engine.check_invariants)
    assert engine.kv.windows == () and engine.runner.kv_cache.shape[1] == loaded.num_layers
    return engine


def assert_transformers_greedy(prompts: list[list[int]], outs: list, name: str = "tiny-gemma3") -> None:
    """Each output's tokens are transformers' greedy choices over prompt and output (teacher-forced)."""
    model = load_model(name, dtype="float32", device="cpu").model
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.slow
def test_a_host_tier_keeps_one_group_and_its_loads_and_swaps_equal_transformers() -> None:
    """A host tier moves every layer of a block, so with one Gemma 3 keeps every layer's blocks
    (the kernel masks the windows), as before KV groups: a 100-token prompt (three windows)
    evicted to the host comes back as a hit, and swap preemption brings back three requests
    that outgrow the device together; every output equals transformers'."""
    rng = random.Random(4)
    a, b, c = (tokens(100, rng) for _ in range(3))
    batch = [tokens(48, rng) for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = one_group_engine(60, host_blocks=240, preemption_mode="swap")
    first = engine.generate([a], params)[0]
    engine.generate([b], params)
    engine.generate([c], params)  # a's 27 blocks no longer fit beside b's and c's: a goes to the host
    again = engine.generate([a], params)[0]
    m = engine.metrics()
    assert again.num_cached_tokens == len(a) - 1 and m["host_cache_hits"] > 0
    long = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    swapped = engine.generate(batch, long)  # 21 blocks each at the end: 63 of 60
    m = engine.metrics()
    assert m["num_preemptions"] > 0 and m["num_swapped_out_blocks"] > 0
    assert_transformers_greedy([a, a, *batch], [first, again, *swapped])
    no_leaks(engine)


def test_a_kv_store_keeps_one_group_and_a_second_engine_hits_what_the_first_stored(tmp_path) -> None:
    """The KV store moves every layer of a block: with one, a second engine over the same store
    fetches a 100-token prompt's blocks that the first computed, and both equal transformers'."""
    prompt = tokens(100, random.Random(5))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with one_group_engine(64, kv_store=f"file://{tmp_path}") as first:
        cold = first.generate([prompt], params)[0]
    with one_group_engine(64, kv_store=f"file://{tmp_path}") as second:
        warm = second.generate([prompt], params)[0]
        assert second.metrics()["store_cache_hits"] == warm.num_cached_tokens == (len(prompt) - 1) // B * B
    assert_transformers_greedy([prompt, prompt], [cold, warm])


@pytest.mark.slow
def test_tensor_parallel_ranks_keep_one_group_and_equal_transformers() -> None:
    """Tensor-parallel ranks step every layer's blocks in lockstep: with two, Gemma 2 (Gemma 3's
    q/k norms have no tensor-parallel plan) keeps one group on each rank, and a prompt three
    windows long that hits another's prefix gives transformers' tokens."""
    rng = random.Random(6)
    shared = tokens(64, rng)
    prompts = [shared + tokens(36, rng) for _ in range(2)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = EngineConfig(
        model="tiny-gemma2",
        dtype="float32",
        device="cpu",
        block_size=B,
        kv_cache_memory="1MiB",
        tensor_parallel_size=2,
    )
    with Engine(config) as engine:
        engine.step_hooks.append(Engine.check_invariants)
        assert engine.kv.windows == ()
        outs = [engine.generate([p], params)[0] for p in prompts]
    assert outs[1].num_cached_tokens == len(shared)
    assert_transformers_greedy(prompts, outs, "tiny-gemma2")


@pytest.mark.slow
def test_decode_graph_buffers_carry_every_groups_slots_and_tables(monkeypatch) -> None:
    """CUDA graphs replay static buffers (`radixkv.model.cuda_graphs`): with KV groups each group
    has its own. On the CPU a stand-in for each captured graph runs the graphs' forward over those
    buffers at replay, so decode steps read every group's KV through them; greedy tokens past the
    window equal transformers'. (`pytest -m gpu` replays real graphs.)"""
    monkeypatch.setattr(cuda_graphs, "plan_attention_gpu", lambda *args: None)  # asks the device
    engine = gemma3_engine(num_blocks=256, max_num_seqs=2)
    graphs = cuda_graphs.DecodeGraphs(engine.runner, 2)
    replays = []

    class Replay:
        def __init__(self, size: int, width: int) -> None:
            self.size, self.width = size, width
            self.logits = torch.zeros(size, engine.vocab_size)

        def replay(self) -> None:
            replays.append(self.size)
            self.logits.copy_(graphs._forward(self.size, self.width))

    for key in set(graphs.routes.values()):
        stand_in = Replay(*key)
        graphs._graphs[key] = (stand_in, stand_in.logits)
    engine.runner.graphs = graphs
    rng = random.Random(7)
    prompts = [tokens(rng.randrange(36, 48), rng) for _ in range(2)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert len(replays) >= 7  # every decode step
    assert_transformers_greedy(prompts, outs)
    no_leaks(engine)
