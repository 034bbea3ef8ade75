"""Structured output and tools through the official `openai` client against the application, with
random weights: whatever the model would say, the grammar makes it parse. The oracle for a JSON
schema is `jsonschema` (installed with the test extra, through ray); choice and regex outputs are
checked with Python's `re`."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from test_server_openai_surface import with_client

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "blue"]},
    },
    "required": ["name", "age", "member", "tier"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 3},
                "days": {"type": "integer", "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Tell me"}]


def test_json_schema_response_parses_and_validates_for_every_sample(model_folders):
    async def test(client, engine):
        return await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            n=3,
            seed=7,
            max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )

    got = with_client(model_folders["llama"], test)
    assert len(got.choices) == 3
    for choice in got.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_beats_a_logit_bias_and_parses(model_folders):
    """`}` pushed by +100 would be the whole reply; the mask lets it close the object only."""

    async def test(client, engine):
        return await client.completions.create(
            model="tiny",
            prompt="x",
            max_tokens=20,
            logit_bias={str(ord("}")): 100},
            extra_body={"response_format": {"type": "json_object"}},
        )

    got = with_client(model_folders["llama"], test)
    assert json.loads(got.choices[0].text) == {}
    assert got.choices[0].finish_reason == "stop"


def test_choice_and_regex_outputs_match_streamed_or_not(model_folders):
    choices = ["alpha", "beta gamma", 'say "hi"']
    pattern = r"[0-9]{3}-[a-z]{2}"

    async def test(client, engine):
        picked = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            n=4,
            max_tokens=30,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        regex = await client.completions.create(
            model="tiny", prompt="id:", max_tokens=30, extra_body={"guided_regex": pattern}
        )
        stream = await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=30,
            stream=True,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
        return picked, regex, streamed

    picked, regex, streamed = with_client(model_folders["llama"], test)
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in picked.choices)
    assert re.fullmatch(pattern, regex.choices[0].text)
    assert re.fullmatch(pattern, streamed)


def test_required_and_named_tool_calls_parse_and_validate(model_folders):
    async def test(client, engine):
        kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=120)
        return await asyncio.gather(  # one batch: the two decode together
            client.chat.completions.create(**kwargs, tool_choice="required", seed=1),
            client.chat.completions.create(
                **kwargs, seed=2, tool_choice={"type": "function", "function": {"name": "weather"}}
            ),
        )

    required, named = with_client(model_folders["llama"], test)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for got in (required, named):
        (choice,) = got.choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert named.choices[0].message.tool_calls[0].function.name == "weather"


def test_forced_tool_call_cut_by_max_tokens_keeps_its_partial_call(model_folders):
    """Greedy, so a cut reply is the uncut one's first tokens (the byte tokenizer: 12 tokens are
    `<tool_call>` and its newline, about 30 more reach the arguments): finish "length", no
    markup in the content, and the call's name with a prefix of the uncut call's arguments;
    with a named function, the call is there however early the cut. Streamed, the same."""
    named = {"type": "function", "function": {"name": "weather"}}
    cuts = (6, 48)

    async def test(client, engine):
        kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], temperature=0)

        async def streamed(choice):
            stream = await client.chat.completions.create(
                **kwargs, tool_choice=choice, max_tokens=cuts[1], stream=True
            )
            return [c async for c in stream]

        asks = [
            client.chat.completions.create(**kwargs, tool_choice=choice, max_tokens=k)
            for choice in (named, "required")
            for k in (120, *cuts)
        ]
        got = await asyncio.gather(*asks, streamed(named), streamed("required"))
        engine.check_invariants()
        return got

    *whole, stream_named, stream_required = with_client(model_folders["llama"], test)
    per_choice = {"named": whole[:3], "required": whole[3:]}
    for kind, (full, early, late) in per_choice.items():
        (want,) = full.choices[0].message.tool_calls
        for got in (early, late):
            (choice,) = got.choices
            assert choice.finish_reason == "length" and choice.message.content is None
        (call,) = late.choices[0].message.tool_calls
        assert call.function.name == want.function.name and call.id.startswith("call_")
        assert want.function.arguments.startswith(call.function.arguments)
        assert 0 < len(call.function.arguments) < len(want.function.arguments)  # cut inside them
        early_calls = early.choices[0].message.tool_calls
        if kind == "named":  # cut inside `<tool_call>`: the named function, no arguments yet
            assert [(c.function.name, c.function.arguments) for c in early_calls] == [("weather", "")]
        else:
            assert early_calls is None
    for chunks, kind in ((stream_named, "named"), (stream_required, "required")):
        late = per_choice[kind][2]
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        assert deltas[0].function.name == late.choices[0].message.tool_calls[0].function.name
        arguments = "".join(d.function.arguments for d in deltas)
        assert arguments == late.choices[0].message.tool_calls[0].function.arguments
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.slow  # about 10 s here: 60 decode steps of the Triton interpreter
def test_streamed_tool_call_assembles_to_the_whole_one(model_folders):
    """Same seed, streamed and not: the deltas (name first, then argument fragments) add up to
    the call the whole response returns."""
    named = {"type": "function", "function": {"name": "weather"}}

    async def test(client, engine):
        kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=120, seed=5)

        async def streamed():
            return [c async for c in await client.chat.completions.create(**kwargs, stream=True)]

        return await asyncio.gather(client.chat.completions.create(**kwargs), streamed())

    whole, chunks = with_client(model_folders["llama"], test)
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "weather" and deltas[0].function.arguments == ""
    assert all(d.index == 0 and d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    arguments = "".join(d.function.arguments for d in deltas)
    want = whole.choices[0].message.tool_calls[0]
    assert arguments == want.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_tool_call_the_model_writes_is_parsed(model_folders):
    """`auto` trusts the model: forced here by a grammar over the Hermes block itself."""
    block = '<tool_call>{"name":"now","arguments":{"zone":"UTC"}}</tool_call>'

    async def test(client, engine):
        return await client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[CLOCK],
            max_tokens=90,
            extra_body={"structured_outputs": {"choice": [block]}},
        )

    (choice,) = with_client(model_folders["llama"], test).choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("now", {"zone": "UTC"})


def test_tool_history_renders_through_the_template(model_folders):
    """An assistant's earlier call and the tool's reply go back through the template."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "now", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]

    async def test(http, engine):
        body = {"model": "tiny", "messages": history, "tools": [CLOCK]}
        return (await http.post("/tokenize", json=body)).json()

    ids = with_client(model_folders["llama"], test, raw=True)["tokens"]
    text = bytes(t for t in ids if t < 256).decode()
    assert '<tool_call>\n{"name": "now", "arguments": {"zone": "UTC"}}\n</tool_call>' in text
    assert (
        "<tool_response>\n12:00\n</tool_response>" in text and '"name": "now"' in text.split("<tools>\n")[1]
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
        ({"use_beam_search": True, "n": 2, "response_format": {"type": "json_object"}}, "response_format"),
        (
            {"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
    ],
)
def test_bad_structured_requests_are_400s_naming_the_field(model_folders, extra, param):
    async def test(client, engine):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=extra)
        return e.value.body

    assert with_client(model_folders["llama"], test)["param"] == param
