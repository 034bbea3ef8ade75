"""The OpenAI surface that clients such as lm-eval send, through the official `openai` client
against the in-process application (httpx's ASGI transport): completions `echo` with prompt
logprobs against transformers, vLLM's `prompt_logprobs`, collision-free `top_logprobs`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from radixkv import AsyncEngine, EngineConfig
from radixkv.model.loader import load_tokenizer
from radixkv.server.app import build_app

PROMPT = "The cat sat on the mat"


def with_client(folder, test: Callable[[Any, Any], Awaitable[Any]], raw: bool = False) -> Any:
    """Runs `test(client, engine)` against a fresh engine and app (`client` the openai client, or
    with `raw` the httpx client under it); returns its result."""

    async def main() -> Any:
        engine = AsyncEngine(EngineConfig(model=str(folder), block_size=4, kv_cache_memory="8MiB"))
        app = build_app(engine, "tiny", session_idle_timeout_s=0)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://radixkv") as http:
            client = openai.AsyncOpenAI(base_url="http://radixkv/v1", api_key="x", http_client=http)
            try:
                return await test(http if raw else client, engine)
            finally:
                await engine.shutdown()

    return asyncio.run(main())


def spelling(token_id: int) -> str:
    """How the byte tokenizer's token is spelled: ASCII as itself, a high byte by its byte."""
    if token_id < 0x80:
        return chr(token_id)
    if token_id < 0x100:
        return f"bytes:\\x{token_id:02x}"
    return ("<|endoftext|>", "<|im_start|>", "<|im_end|>")[token_id - 0x100]


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_logprobs_equal_transformers_as_lm_eval_asks(model_folders, reference_models):
    async def test(client, engine):
        await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)  # caches the prompt
        return await client.completions.create(
            model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0
        )

    got = with_client(model_folders["llama"], test)
    ids = list(PROMPT.encode())  # the byte tokenizer: token = byte
    want = log_softmax(reference_models["llama"], ids)
    (choice,) = got.choices
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(choice.text) == len(PROMPT) + 1
    assert lp.tokens[: len(ids)] == list(PROMPT) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [want[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(ids)):  # logprobs 1: the single most likely token at each position
        best = int(want[i - 1].argmax())
        assert lp.top_logprobs[i] == {spelling(best): pytest.approx(want[i - 1, best].item(), abs=1e-4)}
    assert lp.text_offset[: len(ids)] == list(range(len(ids)))
    assert lp.token_logprobs[-1] == pytest.approx(want[-1].max().item(), abs=1e-4)  # greedy token


def test_echo_with_max_tokens_0_scores_the_prompt_as_lm_eval_asks(model_folders, reference_models):
    """lm-eval's loglikelihood: the prompt's logprobs and nothing generated."""

    async def test(client, engine):
        scored = await client.completions.create(
            model="tiny", prompt=[PROMPT, "A dog"], echo=True, logprobs=1, max_tokens=0
        )
        errors = []
        for extra in ({}, {"echo": True, "min_tokens": 1}):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, extra_body=extra)
            errors.append(info.value.body["param"])
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=0
            )
        errors.append(info.value.body["param"])
        metrics = engine.metrics()
        engine.check_invariants()
        return scored, errors, metrics

    scored, errors, metrics = with_client(model_folders["llama"], test)
    assert errors == ["max_tokens", "min_tokens", "max_tokens"]
    assert metrics["running"] == 0 and metrics["waiting"] == 0
    prompt_tokens = 0
    for choice, prompt in zip(scored.choices, [PROMPT, "A dog"], strict=True):
        ids = list(prompt.encode())
        prompt_tokens += len(ids)
        want = log_softmax(reference_models["llama"], ids)
        assert choice.text == prompt and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp.tokens == list(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [want[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert lp.text_offset == list(range(len(ids)))
    usage = scored.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 0)
    assert usage.total_tokens == prompt_tokens


def test_vllm_prompt_logprobs_on_both_endpoints(model_folders, reference_models):
    async def test(client, engine):
        completion = await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
        )
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"prompt_logprobs": 0},
        )
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        return completion, chat, engine.tokenizer.encode(text, add_special_tokens=False)

    completion, chat, chat_ids = with_client(model_folders["llama"], test)
    model = reference_models["llama"]
    ids = list(PROMPT.encode())
    records = completion.choices[0].model_extra["prompt_logprobs"]
    want = log_softmax(model, ids)
    assert records[0] is None and len(records) == len(ids)
    for i in range(1, len(ids)):
        entry = records[i]
        assert entry[str(ids[i])]["logprob"] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        assert entry[str(ids[i])]["rank"] == int((want[i - 1] > want[i - 1, ids[i]]).sum()) + 1
        top = want[i - 1].topk(2).indices.tolist()
        assert set(entry) == {str(ids[i]), *map(str, top)}
    chat_records = chat.model_extra["prompt_logprobs"]
    want = log_softmax(model, chat_ids)
    assert chat_records[0] is None and len(chat_records) == len(chat_ids)
    assert [r[str(chat_ids[i])]["logprob"] for i, r in enumerate(chat_records) if i] == pytest.approx(
        [want[i - 1, chat_ids[i]].item() for i in range(1, len(chat_ids))], abs=1e-4
    )


def test_echo_and_prompt_logprobs_refused_when_streamed(model_folders):
    async def test(client, engine):
        errors = []
        for extra in ({"echo": True}, {"prompt_logprobs": 1}):
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt="x", stream=True, extra_body=extra)
            errors.append(info.value.body["param"])
        return errors

    assert with_client(model_folders["llama"], test) == ["echo", "prompt_logprobs"]


def test_top_logprobs_keep_every_byte_token_apart(model_folders):
    """Bytes >= 0x80 each decode to "\\ufffd": keyed by text, 5 alternatives collapsed to few."""

    async def test(client, engine):
        # A prompt of high bytes makes high bytes likely; logit_bias-free, so check whatever comes.
        prompt = list(range(0xC0, 0xE0))
        completion = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, logprobs=5, temperature=0
        )
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "\u00e9\u00e8\u00ea"}],
            max_tokens=4,
            logprobs=True,
            top_logprobs=5,
            temperature=0,
        )
        ids = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=2,
            logprobs=5,
            extra_body={"return_tokens_as_token_ids": True},
        )
        return completion, chat, ids

    completion, chat, ids = with_client(model_folders["llama"], test)
    assert all(len(top) == 5 for top in completion.choices[0].logprobs.top_logprobs)
    spelled = [k for top in completion.choices[0].logprobs.top_logprobs for k in top]
    for key in spelled:
        assert "\ufffd" not in key
        if key.startswith("bytes:"):
            assert int(key.removeprefix("bytes:\\x"), 16) >= 0x80
    for entry in chat.choices[0].logprobs.content:
        assert len({t.token for t in entry.top_logprobs}) == 5
        for alt in entry.top_logprobs:  # the token's own byte, never the UTF-8 of "\ufffd"
            if alt.token.startswith("bytes:"):
                assert alt.bytes == [int(alt.token.removeprefix("bytes:\\x"), 16)]
            else:
                assert bytes(alt.bytes).decode() == alt.token
    assert all(k.startswith("token_id:") for top in ids.choices[0].logprobs.top_logprobs for k in top)
    assert all(t.startswith("token_id:") for t in ids.choices[0].logprobs.tokens)


def test_logit_bias_of_100_forces_a_token_and_penalties_are_honoured(model_folders):
    async def test(client, engine):
        forced = await client.completions.create(
            model="tiny", prompt="Hello", max_tokens=5, temperature=1.0, seed=3, logit_bias={"90": 100}
        )
        chat = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            logit_bias={"81": 100},
        )
        plain = await client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        penalized = await client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=8,
            temperature=0,
            extra_body={"repetition_penalty": 5.0, "min_tokens": 8, "min_p": 0.1},
            frequency_penalty=2.0,
        )
        return forced, chat, plain, penalized

    forced, chat, plain, penalized = with_client(model_folders["llama"], test)
    assert forced.choices[0].text == "ZZZZZ"  # token 90 is "Z" in the byte tokenizer
    assert chat.choices[0].message.content == "QQQQ"
    assert penalized.usage.completion_tokens == 8
    assert penalized.choices[0].text != plain.choices[0].text  # the penalties change greedy output


def test_tokenizer_endpoints_and_model_routes_in_vllm_shapes(model_folders):
    messages = [{"role": "user", "content": "hi"}]

    async def test(http, engine):
        text = await http.post("/tokenize", json={"model": "tiny", "prompt": "héllo"})
        chat = await http.post("/tokenize", json={"model": "tiny", "messages": messages})
        back = await http.post("/detokenize", json={"model": "tiny", "tokens": text.json()["tokens"]})
        bad = await http.post("/detokenize", json={"tokens": [10**6]})
        neither = await http.post("/tokenize", json={"model": "tiny"})
        info = await http.get("/tokenizer_info")
        card = await http.get("/v1/models/tiny")
        missing = await http.get("/v1/models/other")
        version = await http.get("/version")
        spec = await http.get("/openapi.json")
        docs = await http.get("/docs")
        template = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        want_chat = engine.tokenizer.encode(template, add_special_tokens=False)
        return text, chat, back, bad, neither, info, card, missing, version, spec, docs, want_chat, engine

    text, chat, back, bad, neither, info, card, missing, version, spec, docs, want_chat, engine = with_client(
        model_folders["llama"], test, raw=True
    )
    want = {"tokens": list("héllo".encode()), "count": 6, "max_model_len": engine.max_model_len}
    assert text.json() == want
    assert chat.json()["tokens"] == want_chat and chat.json()["count"] == len(want_chat)
    assert back.json() == {"prompt": "héllo"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"
    assert info.json()["eos_token"] == "<|im_end|>" and "im_start" in info.json()["chat_template"]
    assert info.json()["tokenizer_class"] == type(load_tokenizer(model_folders["llama"])).__name__
    assert card.json()["id"] == "tiny" and card.json()["object"] == "model"
    assert missing.status_code == 404
    assert version.json()["version"]
    assert "/tokenize" in spec.json()["paths"] and docs.status_code == 200


def test_continuous_usage_stats_put_usage_in_every_chunk(model_folders):
    async def test(client, engine):
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
        return [chunk async for chunk in stream]

    chunks = with_client(model_folders["llama"], test)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].usage.completion_tokens == 5


def test_tool_choice_without_tools_is_refused(model_folders):
    async def test(client, engine):
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], tool_choice="auto"
            )
        return info.value.body

    assert with_client(model_folders["llama"], test)["param"] == "tool_choice"
