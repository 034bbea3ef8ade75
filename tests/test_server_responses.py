"""`POST /v1/responses` through the official `openai` client's `client.responses.create`, whole and
streamed: text against transformers' greedy generation of the same chat prompt, forced tool
calls checked with `jsonschema`, a tool round's items against transformers' own chat template,
and refused fields named in 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from test_server_openai_surface import with_client
from test_server_structured import WEATHER

from radixkv.model.tokenizer import build_byte_tokenizer

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses shape: no `function` wrapper
PARAMS = WEATHER["function"]["parameters"]


def greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=258,
            pad_token_id=256,
        )
    return out[0, len(ids) :].tolist()


def checked_engine(engine) -> dict:
    """The engine's metrics after its invariants hold: no request left, no block leaked."""
    engine.check_invariants()
    return engine.metrics()


def test_text_response_equals_transformers_whole_and_streamed(model_folders, reference_models):
    kwargs = dict(model="tiny", instructions="Be terse.", input="Hello", max_output_tokens=6, temperature=0)

    async def test(client, engine):
        whole = await client.responses.create(**kwargs)
        stream = await client.responses.create(**kwargs, stream=True)
        events = [event async for event in stream]
        return whole, events, checked_engine(engine)

    whole, events, metrics = with_client(model_folders["llama"], test)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}]
    tokenizer = build_byte_tokenizer()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    want = greedy(reference_models["llama"], ids, 6)
    cut = len(want) == 6 and want[-1] != 258
    text = tokenizer.decode(want, skip_special_tokens=True)
    assert whole.object == "response" and whole.model == "tiny"
    assert whole.output_text == text
    (item,) = whole.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert whole.status == ("incomplete" if cut else "completed")
    assert (whole.incomplete_details.reason if cut else whole.incomplete_details) == (
        "max_output_tokens" if cut else None
    )
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens) == (len(ids), len(want))
    assert usage.total_tokens == len(ids) + len(want)

    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e.text for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert deltas == done == final.output_text == text
    assert final.status == whole.status and final.usage.output_tokens == len(want)
    assert metrics["running"] == 0 and metrics["waiting"] == 0


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "weather"}])
def test_forced_function_call_whole_and_streamed(model_folders, choice):
    kwargs = dict(model="tiny", input="Weather?", tools=[TOOL], tool_choice=choice, max_output_tokens=120)

    async def test(client, engine):
        whole = await client.responses.create(**kwargs, temperature=0)
        stream = await client.responses.create(**kwargs, temperature=0, stream=True)
        return whole, [event async for event in stream], checked_engine(engine)

    whole, events, metrics = with_client(model_folders["llama"], test)
    assert whole.status == "completed"
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), PARAMS)

    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds  # a reply that is only a call: no message
    (added,) = [e.item for e in events if e.type == "response.output_item.added"]
    assert added.type == "function_call" and added.name == "weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    (streamed,) = events[-1].response.output
    assert deltas == done == streamed.arguments == call.arguments  # greedy: the same call
    assert streamed.call_id == added.call_id and streamed.status == "completed"
    assert metrics["running"] == 0


def test_a_tool_round_in_input_renders_as_the_chat_template_renders_it(model_folders):
    """An earlier call and its output, sent back as items, are the prompt the template makes of
    the same conversation (counted by `usage.input_tokens`)."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Osl"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
    ]

    async def test(client, engine):
        return await client.responses.create(model="tiny", input=items, tools=[TOOL], max_output_tokens=1)

    got = with_client(model_folders["llama"], test)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Osl"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]
    tokenizer = build_byte_tokenizer()
    text = tokenizer.apply_chat_template(
        messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert got.usage.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"temperature": -1}, "temperature"),
        # Refused by the chat body `input` becomes (its json_schema name is at most 64 characters).
        ({"text": {"format": {"type": "json_schema", "name": "n" * 65, "schema": PARAMS}}}, "text"),
    ],
)
def test_refused_fields_are_400s_naming_them(model_folders, extra, param):
    async def test(client, engine):
        body = {"model": "tiny", "input": "Hi", **extra}
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(**body)
        return info.value.body

    assert with_client(model_folders["llama"], test)["param"] == param


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_partial_call(model_folders):
    kwargs = dict(model="tiny", input="Weather?", tools=[TOOL], temperature=0)
    named = {"type": "function", "name": "weather"}

    async def test(client, engine):
        full = await client.responses.create(**kwargs, tool_choice=named, max_output_tokens=120)
        cut = await client.responses.create(**kwargs, tool_choice=named, max_output_tokens=48)
        return full, cut

    full, cut = with_client(model_folders["llama"], test)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    (call,) = cut.output  # no message item: the markup is never text
    assert call.type == "function_call" and call.name == "weather" and call.status == "incomplete"
    assert full.output[0].arguments.startswith(call.arguments) and call.arguments != full.output[0].arguments
