"""The engine end to end: continuous batching, preemption, chat, parallel sampling, bad input.

Outputs are checked against transformers' greedy `generate` on the same weights, and the cache's
books (`check_invariants`) after every step of the runs that stress it.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from radixkv import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def transformers_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_tokens,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


def prompts(n: int, seed: int, low: int = 4, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(low, high))] for _ in range(n)]


def checked(engine: Engine) -> Engine:
    engine.step_hooks.append(Engine.check_invariants)
    return engine


def no_leaks(engine: Engine) -> None:
    engine.check_invariants()
    cache = engine.kv.cache
    reserved = engine.kv.null_block >= 0  # with KV groups, the manager's null block
    cached = cache.evictable_size + len(cache.stale) if cache else 0
    assert engine.pool.num_free + cached == engine.pool.num_blocks - reserved


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_requests_arriving_while_others_decode_match_transformers(model_folders, reference_models, overlap):
    engine = checked(
        Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB", overlap=overlap)
    )
    batch = prompts(6, seed=1)
    early = [engine.add_request(p, GREEDY) for p in batch[:3]]
    for _ in range(4):
        engine.step()
    late = [engine.add_request(p, GREEDY) for p in batch[3:]]
    engine.run_until(lambda: all(engine.is_finished(i) for i in early + late))
    outs = [engine.output(i) for i in early + late]
    for prompt, out in zip(batch, outs, strict=True):
        assert out.token_ids == transformers_greedy(reference_models["llama"], prompt, 10)
        assert out.token_ids == engine.generate([prompt], GREEDY)[0].token_ids  # alone
    no_leaks(engine)


def test_preemption_under_memory_pressure_keeps_outputs_and_books(model_folders):
    batch = prompts(8, seed=2, low=20, high=40)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    expected = [o.token_ids for o in roomy.generate(batch, params)]
    # 2 layers x 2 KV heads x 16 dims x 4 tokens x 2 (K and V) x 4 bytes = 2 KiB a block: 48 blocks.
    tight = checked(Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="96KiB"))
    assert tight.pool.num_blocks == 48
    outs = tight.generate(batch, params)
    assert [o.token_ids for o in outs] == expected
    assert tight.metrics()["num_preemptions"] > 0
    no_leaks(tight)


def test_second_chat_turn_hits_the_whole_first_turn(model_folders):
    engine = checked(Engine.from_pretrained(model_folders["llama"], block_size=16, kv_cache_memory="8MiB"))
    chat = engine.chat(system="You are terse.")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = chat.send("Hi! Tell me about the sea.", params)
    second = chat.send("And the mountains?", params)
    earlier = len(first.prompt_token_ids) + len(first.token_ids)
    assert second.num_cached_tokens >= earlier - 16
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[2]["content"] == first.text


def test_sessions_with_one_system_prompt_hold_its_blocks_once(model_folders):
    engine = checked(Engine.from_pretrained(model_folders["llama"], block_size=16, kv_cache_memory="16MiB"))
    system = [random.Random(3).randrange(256) for _ in range(512)]
    users = prompts(16, seed=4, low=20, high=30)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    peak = 0

    def track(e: Engine) -> None:
        nonlocal peak
        peak = max(peak, e.pool.num_blocks - e.pool.num_free)

    engine.step_hooks.append(track)
    outs = engine.generate([system + u for u in users], params)
    # One session prefilled the system prompt while the others waited; they then found all of it.
    assert sorted(o.num_cached_tokens >= 512 for o in outs) == [False] + [True] * 15
    per_session = max(-(-(len(u) + 4) // 16) + 1 for u in users)
    assert peak <= 512 // 16 + 16 * per_session  # the system prompt's 32 blocks once, not 16 times
    no_leaks(engine)


def test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(model_folders, reference_models):
    engine = checked(
        Engine.from_pretrained(
            model_folders["qwen2"], block_size=8, kv_cache_memory="8MiB", max_num_batched_tokens=32
        )
    )
    long, short = prompts(1, seed=12, low=150, high=151)[0], prompts(1, seed=13)[0]
    outs = engine.generate([long, short], GREEDY)
    assert outs[0].token_ids == transformers_greedy(reference_models["qwen2"], long, 10)
    assert outs[1].token_ids == transformers_greedy(reference_models["qwen2"], short, 10)
    no_leaks(engine)


def test_threads_submit_and_wait_concurrently(model_folders, reference_models):
    engine = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    batch = prompts(6, seed=14)
    results: dict[int, list[int]] = {}

    def user(i: int) -> None:
        results[i] = engine.generate([batch[i]], GREEDY)[0].token_ids

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, prompt in enumerate(batch):
        assert results[i] == transformers_greedy(reference_models["llama"], prompt, 10)
    no_leaks(engine)


def test_parallel_samples_are_seeded_and_share_the_prompt(model_folders):
    engine = checked(Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB"))
    prompt = prompts(1, seed=5, low=30, high=31)[0]
    params = SamplingParams(max_tokens=8, temperature=1.0, n=4, seed=7)
    peak = 0

    def track(e: Engine) -> None:
        nonlocal peak
        peak = max(peak, e.pool.num_blocks - e.pool.num_free)

    engine.step_hooks.append(track)
    first = engine.generate([prompt], params)[0]
    prompt_blocks = -(-len(prompt) // 4)
    assert peak <= prompt_blocks + 4 * (8 // 4 + 1)  # the prompt's blocks once, not four times
    assert engine.metrics()["num_cow_copies"] >= 3  # the partly filled last block, copied per sample
    again = engine.generate([prompt], params)[0]
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in again.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) > 1
    no_leaks(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    prompt = prompts(1, seed=6)[0]
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11)
    alone = engine.generate([prompt], params)[0].token_ids
    crowd = engine.generate([prompt, *prompts(5, seed=8)], params)[0].token_ids
    assert alone == crowd


def test_stream_yields_the_generated_tokens_in_order(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    prompt = prompts(1, seed=9)[0]
    pieces = list(engine.stream(prompt, GREEDY))
    assert [p.token_id for p in pieces] == engine.generate([prompt], GREEDY)[0].token_ids
    assert pieces[-1].finish_reason is not None and all(p.finish_reason is None for p in pieces[:-1])


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], GREEDY, "prompt"),
        ([1, 2, 10**6], GREEDY, "prompt token ids"),
        ([1] * 2048, GREEDY, "max_model_len"),
        ([1, 2], SamplingParams(max_tokens=400, n=64), "KV blocks"),
        ("hello", "greedy", "params"),
    ],
)
def test_bad_input_is_refused_at_the_door_and_harms_nothing(model_folders, prompt, params, field):
    engine = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="64KiB")
    good = engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, params)
    engine.run_until(lambda: engine.is_finished(good))
    assert len(engine.output(good).token_ids) >= 1
    no_leaks(engine)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_metrics_count_the_cache_and_export_prometheus(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    prompt = prompts(1, seed=10, low=30, high=31)[0]
    engine.generate([prompt], GREEDY)
    engine.generate([prompt], GREEDY)
    m = engine.metrics()
    assert m["prefix_cache_queries"] == 2 * len(prompt)
    assert m["prefix_cache_hits"] == len(prompt) - 1
    assert m["time_to_first_token_seconds"]["count"] == 2
    text = engine.metrics_text()
    assert "radixkv_prefix_cache_hits_total" in text
    assert 'radixkv_time_to_first_token_seconds_bucket{le="+Inf"} 2' in text
