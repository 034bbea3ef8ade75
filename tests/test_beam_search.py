"""Beam search inside the engine against transformers' `generate(num_beams=k)` on the same weights."""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixkv import BeamSearchParams, Engine

PROMPTS = 10


def transformers_beams(model, prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=params.beam_width,
        num_return_sequences=params.beam_width,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        do_sample=False,
        max_new_tokens=params.max_tokens,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=model.config.pad_token_id,
    )
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        generated = seq[len(prompt) :]
        while generated and generated[-1] == model.config.pad_token_id:  # padding of shorter beams
            generated.pop()
        beams.append((generated, score))
    return beams


@pytest.mark.parametrize(
    ("model_name", "width", "length_penalty", "early_stopping"),
    [
        ("llama", 2, 1.0, True),
        ("llama", 4, 0.5, False),
        ("qwen2", 2, 2.0, "never"),
        ("qwen2", 4, 1.0, True),
    ],
)
def test_beam_search_equals_transformers(
    model_folders, reference_models, model_name, width, length_penalty, early_stopping
):
    engine = Engine.from_pretrained(model_folders[model_name], block_size=4, kv_cache_memory="16MiB")
    params = BeamSearchParams(
        beam_width=width, max_tokens=12, length_penalty=length_penalty, early_stopping=early_stopping
    )
    rng = random.Random(width)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 20))] for _ in range(PROMPTS)]
    for prompt, ours in zip(prompts, search_all(engine, prompts, params), strict=True):
        expected = transformers_beams(reference_models[model_name], prompt, params)
        assert ours[0].token_ids == expected[0][0], "best beam differs"
        assert sorted(b.token_ids for b in ours) == sorted(t for t, _ in expected)
        for beam, (_, score) in zip(ours, expected, strict=True):
            assert beam.score == pytest.approx(score, abs=1e-4)
    engine.check_invariants()
    assert engine.pool.num_free + engine.kv.cache.evictable_size == engine.pool.num_blocks


def search_all(engine: Engine, prompts: list[list[int]], params: BeamSearchParams):
    ids = [engine.add_request(p, params) for p in prompts]  # all searches share the engine's steps
    engine.run_until(lambda: all(engine.is_finished(i) for i in ids))
    return [engine.beam_output(i) for i in ids]


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_beams_that_end_early_on_eos_equal_transformers(
    model_folders, reference_models, tmp_path, early_stopping
):
    """With random weights EOS is rare; declaring the model's favourite token an EOS as well makes
    beams finish at every length, which exercises the finished-hypothesis bookkeeping."""
    rng = random.Random(42)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 20))] for _ in range(PROMPTS)]
    model = reference_models["llama"]
    made = Counter()
    for p in prompts:
        out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, pad_token_id=256)
        made.update(out[0, len(p) :].tolist())
    favourite = made.most_common(1)[0][0]
    folder = tmp_path / "eos"
    shutil.copytree(model_folders["llama"], folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = [favourite, 258]
        (folder / name).write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine.from_pretrained(folder, block_size=4, kv_cache_memory="16MiB")
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=1.0, early_stopping=early_stopping)
    shorter = 0
    for prompt, ours in zip(prompts, search_all(engine, prompts, params), strict=True):
        expected = transformers_beams(reference, prompt, params)
        assert [b.token_ids for b in ours] == [t for t, _ in expected]
        assert [b.score for b in ours] == pytest.approx([s for _, s in expected], abs=1e-4)
        shorter += sum(len(b.token_ids) < params.max_tokens for b in ours)
    assert shorter > 0, "no beam ended on EOS: the test did not exercise what it is for"
    engine.check_invariants()


@pytest.mark.slow
def test_beams_share_blocks_peak_within_1_3x_of_one_sequence():
    engine = Engine.from_pretrained("tiny-llama", block_size=16, kv_cache_memory="64MiB")
    peak = 0

    def track(e: Engine) -> None:
        nonlocal peak
        peak = max(peak, e.pool.num_blocks - e.pool.num_free)

    engine.step_hooks.append(track)
    prompt = [random.Random(0).randrange(256) for _ in range(1024)]
    beams = engine.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True))
    assert len(beams) == 4 and all(len(b.token_ids) == 64 for b in beams)
    single = -(-(1024 + 64) // 16)
    assert peak <= 1.3 * single, f"peak {peak} blocks vs {single} for one sequence"


def test_beam_search_rejects_bad_width():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0)


def test_beam_searches_preempted_for_memory_give_the_same_beams(model_folders):
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 40))] for _ in range(6)]
    params = BeamSearchParams(beam_width=3, max_tokens=16)
    roomy = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    tight = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="120KiB")
    tight.step_hooks.append(Engine.check_invariants)
    expected = search_all(roomy, prompts, params)
    got = search_all(tight, prompts, params)
    assert tight.metrics()["num_preemptions"] > 0
    for ours, theirs in zip(got, expected, strict=True):
        assert [b.token_ids for b in ours] == [b.token_ids for b in theirs]
        assert [b.score for b in ours] == pytest.approx([b.score for b in theirs], abs=1e-5)
    assert tight.pool.num_free + tight.kv.cache.evictable_size == tight.pool.num_blocks
