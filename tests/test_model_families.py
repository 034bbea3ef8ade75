"""Every supported family's tiny preset in the engine against transformers' `generate` on the same weights.

The sliding-window presets (Gemma 2 and 3, Phi-3) have a 32-token window, so prompts and outputs
run past it: prefix hits that end past the window, copy-on-write between beams and recompute after
preemption all meet windowed and soft-capped attention. The fast tier checks each family's logits
over two runner steps and Mistral in the engine; the slow tests run every family in the engine,
with prompts and outputs several windows long.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_beam_search import search_all, transformers_beams
from test_engine import no_leaks, transformers_greedy

from radixkv import BeamSearchParams, Engine, EngineConfig, SamplingParams
from radixkv.cache.kv_groups import kv_groups
from radixkv.model.loader import LoadedModel, layer_windows, load_model
from radixkv.model.presets import PRESETS, SLIDING_WINDOW
from radixkv.model.runner import ModelRunner, kv_block_bytes
from radixkv.scheduler.chunk import SequenceChunk

FAMILIES = ["tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3", "tiny-mixtral", "tiny-qwen2-moe"]
FAMILIES.append("tiny-qwen3-moe")
WINDOWED = ["tiny-gemma2", "tiny-gemma3", "tiny-phi3"]


def oracle(name: str) -> LoadedModel:
    """The preset's weights as a plain transformers model, never bound to a runner."""
    return load_model(name, dtype="float32", device="cpu")


def engine_for(name: str, num_blocks: int | None = None, block_size: int = 4, **config: object) -> Engine:
    """The preset in an engine with `num_blocks` KV blocks (roomy when None), invariants checked each
    step. With KV groups (`radixkv.cache.kv_groups`) a block holds one group's layers."""
    loaded = oracle(name)
    layers = kv_groups(loaded.layer_windows).layers_per_group
    block = kv_block_bytes(layers, block_size, loaded.num_kv_heads, loaded.head_dim, torch.float32)
    engine = Engine(
        EngineConfig(
            model=name,
            dtype="float32",
            device="cpu",
            block_size=block_size,
            kv_cache_memory=block * (num_blocks or 1024),
            **config,
        )
    )
    engine.step_hooks.append(Engine.check_invariants)
    return engine


def run_after_shared_prefix(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, shared: int
) -> list:
    """Runs two prompts to the end, the second added once the cache holds the first's `shared`
    leading tokens (so that it can hit them), and returns their outputs."""
    first = engine.add_request(prompts[0], params)
    for _ in range(10):
        engine.step()
        if engine.kv.cached_prefix_len(prompts[0]) >= shared:
            break
    else:
        raise AssertionError("the first prompt's shared prefix was never cached")
    second = engine.add_request(prompts[1], params)
    engine.run_until(lambda: engine.is_finished(first) and engine.is_finished(second))
    return [engine.output(first), engine.output(second)]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_presets_window_the_layers_transformers_windows() -> None:
    windows = {name: layer_windows(PRESETS[name]()) for name in FAMILIES}
    assert windows["tiny-gemma2"] == (SLIDING_WINDOW, None) * 2
    assert windows["tiny-gemma3"] == (SLIDING_WINDOW,) * 5 + (None,)
    assert windows["tiny-phi3"] == (SLIDING_WINDOW,) * 4
    for name in ("tiny-qwen3", "tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"):
        assert windows[name] == (None,) * 4
    for name in WINDOWED:  # the model really is windowed: its output changes without the window
        loaded = oracle(name)
        ids = torch.tensor([tokens(3 * SLIDING_WINDOW, seed=0)])
        with torch.no_grad():
            windowed = loaded.model(ids).logits
            loaded.config.sliding_window = 10**6
            assert not torch.allclose(loaded.model(ids).logits, windowed, atol=1e-3)


@pytest.mark.parametrize(
    ("name", "split"), [(name, True) for name in FAMILIES] + [("tiny-gemma2", False), ("tiny-gemma3", False)]
)
def test_prefill_then_extend_past_the_window_gives_transformers_logits(name: str, split: bool) -> None:
    """Two runner steps: 45 tokens, then 12 more over the cached 45 on shuffled blocks; every row's
    logits equal transformers' forward over the whole 57, within float noise (the experts amplify it:
    transformers' own sdpa and eager attention differ by up to 8e-4 on tiny-mixtral). Each KV group
    (`radixkv.cache.kv_groups`) has its own shuffled blocks; unsplit, Gemma keeps one group of every
    layer (the layout with a host tier, a KV store or tensor parallelism)."""
    loaded = oracle(name)
    reference = load_model(name, dtype="float32", device="cpu").model
    layout = kv_groups(loaded.layer_windows, split)
    groups = layout.num_groups
    assert groups == 1 or split
    runner = ModelRunner(loaded, num_blocks=20 * groups, block_size=4, groups=layout)
    ids = tokens(57, seed=5)
    shuffled = random.Random(0).sample(range(20 * groups), 15 * groups)
    table, others = shuffled[:15], [shuffled[15 * g : 15 * g + 15] for g in range(1, groups)]
    first = runner.forward([SequenceChunk(ids[:45], 0, table[:12], "all", [t[:12] for t in others])])
    second = runner.forward([SequenceChunk(ids[45:], 45, table, "all", others)])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=4e-3, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_past_the_window_with_a_prefix_hit_equals_transformers(name: str) -> None:
    """A prompt past the window, then the same conversation extended: its prefix hit ends past the window."""
    model = oracle(name).model
    engine = engine_for(name)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    first = tokens(SLIDING_WINDOW + 13, seed=1)
    out = engine.generate([first], params)[0]
    assert out.token_ids == transformers_greedy(model, first, 6)
    second = first + out.token_ids + tokens(9, seed=2)
    again = engine.generate([second], params)[0]
    assert again.num_cached_tokens >= len(first) - 4
    assert again.token_ids == transformers_greedy(model, second, 6)
    no_leaks(engine)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_long_greedy_with_prefix_hits_and_preemption_equals_transformers(name: str) -> None:
    """Two ~200-token prompts sharing 120 tokens, then 64 tokens each (twice the window), on blocks for
    one and a half of them: the second hits the first's prefix, and one of them is preempted. With KV
    groups the sliding layers hold only their windows, so the pool is smaller and prefill chunks
    keep one request's peak under it. tiny-gemma3's 180 blocks (with 64-token chunks, 200 let both
    decode to the end side by side) hold the first request and the window before the second's hit
    while the first prefills: the second, waiting, keeps it (`KVCacheManager.keep_window`)."""
    model = oracle(name).model
    shared = tokens(120, seed=3)
    prompts = [shared + tokens(80 + 7 * i, seed=4 + i) for i in range(2)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    grouped = {"tiny-gemma2": (100, 32), "tiny-gemma3": (180, 32)}
    if name in grouped:
        pool, chunk = grouped[name]
        engine = engine_for(name, num_blocks=pool, max_num_batched_tokens=chunk)
    else:
        engine = engine_for(name, num_blocks=90)
    outs = run_after_shared_prefix(engine, prompts, params, len(shared))
    assert engine.metrics()["num_preemptions"] > 0
    assert outs[1].num_cached_tokens >= 120
    for prompt, out in zip(prompts, outs, strict=True):
        # Teacher-forced greedy: EOS is ignored here, which generate's min_new_tokens would suppress.
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert out.token_ids == logits.argmax(-1).tolist()
    no_leaks(engine)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_beams_past_the_window_equal_transformers(name: str) -> None:
    """Beams share their prompt's blocks and copy the partial last one (copy-on-write) past the window."""
    model = oracle(name).model
    engine = engine_for(name)
    params = BeamSearchParams(beam_width=3, max_tokens=40)
    prompts = [tokens(70, seed=9), tokens(70, seed=9)[:60] + tokens(30, seed=10)]
    for prompt, ours in zip(prompts, search_all(engine, prompts, params), strict=True):
        expected = transformers_beams(model, prompt, params)
        assert ours[0].token_ids == expected[0][0], "best beam differs"
        assert sorted(b.token_ids for b in ours) == sorted(t for t, _ in expected)
        for beam, (_, score) in zip(ours, expected, strict=True):
            assert beam.score == pytest.approx(score, abs=1e-4)
    assert engine.metrics()["num_cow_copies"] > 0
    no_leaks(engine)


def test_mistral_past_its_window_equals_transformers(mistral: LoadedModel, tmp_path) -> None:
    """Mistral's window (64 here) no longer caps max_model_len: 90-token prompts, one hitting the other."""
    mistral.model.save_pretrained(tmp_path)
    mistral.tokenizer.save_pretrained(tmp_path)
    engine = Engine.from_pretrained(tmp_path, block_size=4, kv_cache_memory="8MiB")
    engine.step_hooks.append(Engine.check_invariants)
    assert engine.max_model_len == 2048
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = tokens(90, seed=11)
    second = first[:80] + tokens(10, seed=12)
    outs = [engine.generate([p], params)[0] for p in (first, second)]
    assert outs[1].num_cached_tokens == 80
    for prompt, out in zip((first, second), outs, strict=True):
        assert out.token_ids == transformers_greedy(mistral.model, prompt, 4)
    no_leaks(engine)
