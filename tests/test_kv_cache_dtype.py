"""`kv_cache_dtype="int8"` in the engine: the budget holds the smaller blocks, greedy outputs and
teacher-forced next tokens are those of transformers with the same K/V quantization, on three
families, and a prompt served from the cache (device, host tier, a restarted engine's store)
gives exactly the tokens it gives computed fresh at int8: the cached blocks carry their scales.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_engine import transformers_greedy
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from radixkv import Engine, EngineConfig, SamplingParams
from radixkv.kernels.reference import dequantize_ref, quantize_ref
from radixkv.kernels.scale_code import SCALE_CODE_DTYPE
from radixkv.model.loader import load_model
from radixkv.model.presets import PRESETS
from radixkv.model.runner import ModelRunner, kv_block_bytes
from radixkv.scheduler.chunk import SequenceChunk

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
INT8_KV = "radixkv_test_int8_kv"


def prompts(n: int, seed: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def int8_engine(model_folders, **kwargs) -> Engine:
    e = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_dtype="int8", **kwargs)
    e.step_hooks.append(Engine.check_invariants)
    return e


def test_int8_budget_holds_about_twice_bfloat16_blocks_and_four_times_float32():
    # The engine's count at one budget: float32 tiny-llama (head size 32: 128 bytes a head, 33 at int8).
    counts = {}
    for kv_cache_dtype in ("auto", "int8"):
        config = EngineConfig(model="tiny-llama", kv_cache_memory="1MiB", kv_cache_dtype=kv_cache_dtype)
        with Engine(config) as engine:
            counts[kv_cache_dtype] = engine.metrics()["num_blocks"]
    assert counts["int8"] >= 3.7 * counts["auto"]
    # Against bfloat16 at the real shapes' head sizes (128), 64, and the tiny presets' 32: a scale is
    # one byte a head.
    llama = PRESETS["llama-3-8b-shape"]()
    real = (llama.num_hidden_layers, 16, llama.num_key_value_heads, llama.head_dim)
    for sizes in (real, (28, 16, 2, 64), (2, 16, 2, 32)):
        bf16 = kv_block_bytes(*sizes, torch.bfloat16)
        assert bf16 / kv_block_bytes(*sizes, torch.bfloat16, "int8") >= 1.9


def int8_kv_attention(module, query, key, value, *args, **kwargs):
    """transformers' SDPA attention over K and V rounded as an int8 cache stores them (the plain-torch
    reference quantization, per token and head): the oracle of an int8 engine."""
    key, value = (dequantize_ref(*quantize_ref(x, torch.int8, SCALE_CODE_DTYPE)) for x in (key, value))
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


AttentionInterface.register(INT8_KV, int8_kv_attention)


def test_int8_greedy_and_teacher_forced_tokens_match_transformers_on_three_families():
    """40 greedy tokens of 9 held-out prompts (3 a family) against transformers' greedy `generate`
    with its K/V quantized as the cache stores them: at least 8 equal. Then each prompt with that
    continuation, teacher-forced: the engine's most likely next token (prompt_logprobs) is
    transformers' at >= 99% of the positions. (Against full precision these tiny random models
    lose more, their attention logits being far sharper than a trained model's: see
    docs/kv-quantization.md for the measured figures.)"""
    equal, agree, positions = 0, 0, 0
    for family_seed, name in enumerate(FAMILIES):
        oracle = copy.deepcopy(load_model(name, dtype="float32", device="cpu").model)
        oracle.set_attn_implementation(INT8_KV)
        batch = prompts(3, seed=100 + family_seed, low=20, high=60)
        expected = [transformers_greedy(oracle, p, 40) for p in batch]
        config = EngineConfig(model=name, dtype="float32", kv_cache_dtype="int8", kv_cache_memory="4MiB")
        with Engine(config) as e:
            outs = e.generate(batch, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            equal += sum(o.token_ids == want for o, want in zip(outs, expected, strict=True))
            forced = [p + want for p, want in zip(batch, expected, strict=True)]
            scored = e.generate(forced, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        for sequence, out in zip(forced, scored, strict=True):
            with torch.no_grad():
                top = oracle(torch.tensor([sequence])).logits[0, :-1].argmax(-1).tolist()
            mine = [lp.top[0][0] for lp in out.prompt_logprobs[1:]]
            agree += sum(a == b for a, b in zip(mine, top, strict=True))
            positions += len(top)
    assert equal >= 8, f"{equal} of 9 greedy outputs equal transformers'"
    assert agree / positions >= 0.99, f"top-1 agreement {agree}/{positions}"


def test_int8_next_token_distributions_stay_near_full_precision_transformers():
    """Teacher-forced over 1,024 random tokens, the int8 cache's next-token distributions against
    full-precision transformers on `tiny-qwen3`, the preset whose q/k norms keep its attention
    logits at a trained model's scale (std 1.0, against 23 on `tiny-llama`). Measured: top-1
    0.977, mean KL 0.0017 nats; a cache rounded
    to bfloat16 instead gives 0.991 and 0.0002 (docs/kv-quantization.md). The bounds leave room
    for the prompt's draw; against the transformers oracle, so an error in the quantization's
    arithmetic that the reference shares would still show."""
    loaded = load_model("tiny-qwen3", dtype="float32", device="cpu")
    rng = random.Random(0)
    tokens = [rng.randrange(256) for _ in range(1024)]
    with torch.no_grad():
        full = loaded.model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    runner = ModelRunner(loaded, 64, 16, kv_cache_dtype="int8")
    try:
        mine = runner.forward([SequenceChunk(tokens, 0, list(range(64)), logits="all")]).log_softmax(-1)
    finally:
        runner.close()
    top1 = (full.argmax(-1) == mine.argmax(-1)).float().mean().item()
    kl = (full.exp() * (full - mine)).sum(-1).mean().item()
    assert top1 >= 0.95 and 1e-5 < kl < 0.005, f"top-1 {top1:.3f}, mean KL {kl:.4f}"


def test_a_prompt_served_from_the_device_cache_gives_the_tokens_computed_fresh(model_folders):
    batch = prompts(3, seed=1, low=30, high=50)
    shared = batch[0][:24]
    batch.append(shared + batch[1][:10])  # a hit on batch[0]'s first blocks, then its own tokens
    with int8_engine(model_folders, kv_cache_memory="1MiB", enable_prefix_cache=False) as fresh:
        expected = [fresh.generate([p], GREEDY)[0].token_ids for p in batch]
    with int8_engine(model_folders, kv_cache_memory="1MiB") as e:
        first = [e.generate([p], GREEDY)[0] for p in batch]
        again = [e.generate([p], GREEDY)[0] for p in batch]
        assert first[3].num_cached_tokens == 24 and all(o.num_cached_tokens > 0 for o in again)
        assert e.metrics()["num_free_blocks"] + e.kv.cache.evictable_size == e.metrics()["num_blocks"]
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected


def test_a_prompt_loaded_back_from_the_host_tier_gives_the_tokens_computed_fresh(model_folders):
    a, b, c = prompts(3, seed=2, low=100, high=101)
    per_block = kv_block_bytes(2, 4, 2, 16, torch.float32, "int8")
    assert per_block == 2 * 2 * (4 * 2 * 16 + 16)  # values, then one-byte scale codes (16-byte aligned)
    # at 16 slots of 2 heads the codes take 32 bytes (float16 scales took 64)
    assert kv_block_bytes(2, 16, 2, 16, torch.float32, "int8") == 2 * 2 * (16 * 2 * 16 + 32)
    with int8_engine(model_folders, kv_cache_memory="1MiB", enable_prefix_cache=False) as fresh:
        expected = fresh.generate([a], GREEDY)[0].token_ids
    e = int8_engine(model_folders, kv_cache_memory=48 * per_block, host_kv_cache_memory=128 * per_block)
    with e:
        assert (e.pool.num_blocks, e.kv.cache.host.pool.num_blocks) == (48, 128)
        first = e.generate([a], GREEDY)[0]
        e.generate([b], GREEDY)
        e.generate([c], GREEDY)  # a no longer fits beside b and c: it goes to the host
        assert e.metrics()["num_offloaded_blocks"] >= 25
        again = e.generate([a], GREEDY)[0]
        m = e.metrics()
    assert again.num_cached_tokens == len(a) - 1 and m["host_cache_hits"] >= 96
    assert again.token_ids == first.token_ids == expected


def test_a_restarted_engine_served_from_the_store_gives_the_tokens_computed_fresh(model_folders, tmp_path):
    batch = prompts(2, seed=3, low=30, high=40)
    url = f"file://{tmp_path}"
    with int8_engine(model_folders, kv_cache_memory="1MiB", enable_prefix_cache=False) as fresh:
        expected = [o.token_ids for o in fresh.generate(batch, GREEDY)]
    with int8_engine(model_folders, kv_cache_memory="1MiB", kv_store=url) as first:
        cold = [o.token_ids for o in first.generate(batch, GREEDY)]
        # The store's payload is the int8 block, scales included: 3.6x fewer bytes than float32.
        assert first.store.payload_size == kv_block_bytes(2, 4, 2, 16, torch.float32, "int8")
        assert kv_block_bytes(2, 4, 2, 16, torch.float32) / first.store.payload_size > 3.5
    with int8_engine(model_folders, kv_cache_memory="1MiB", kv_store=url) as second:
        warm = second.generate(batch, GREEDY)
        hits = second.metrics()["store_cache_hits"]
    assert hits > 0 and all(o.num_cached_tokens > 0 for o in warm)
    assert cold == [o.token_ids for o in warm] == expected
    # A full-precision engine over the same store finds none of the int8 blocks.
    folder = model_folders["llama"]
    with Engine.from_pretrained(folder, block_size=4, kv_cache_memory="1MiB", kv_store=url) as full:
        assert all(o.num_cached_tokens == 0 for o in full.generate(batch, GREEDY))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of auto, int8, fp8_e4m3"),
        ({"kv_cache_dtype": "fp8_e4m3", "device": "cpu"}, "fp8_e4m3' needs a CUDA device of compute"),
    ],
)
def test_bad_kv_cache_dtype_is_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)
