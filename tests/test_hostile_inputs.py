"""Issue 51's hostile inputs, from outside (raw HTTP and the official `openai` client over an
in-process ASGI transport): refusals that quote a bounded excerpt of what was sent and name the
field, schemas with no finite value refused as 400s, tool-schema errors in the user's terms
with no grammar text, and the stop-string length limit."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_server_openai_surface import with_client

from radixkv import RequestError, SamplingParams
from radixkv.sampling_params import MAX_STOP_CHARS
from radixkv.structured import StructuredOutputs, grammar
from radixkv.structured.finite import has_finite_value

ASK = [{"role": "user", "content": "Tell me"}]
BOUND = 1024  # bytes: a whole error body, message and all
SELF_OBJECT = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
SELF_ARRAY = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
LIST = {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}  # recursive, but `[]` ends it


def test_refusals_quote_a_bounded_excerpt_and_name_the_field(model_folders):
    huge = "x" * 200_000
    bodies = {  # each: what a hostile client sent, and the field its 400 (or 404) must name
        "stop": {"prompt": "a", "stop": [f"s{i}" for i in range(10_000)]},
        "logit_bias": {"prompt": "a", "logit_bias": {huge: 1}},
        "structured_outputs": {"prompt": "a", "structured_outputs": {huge: 1}},
        "stop_token_ids": {"prompt": "a", "stop_token_ids": [-1] * 50_000},
        "model": {"prompt": "a", "model": huge},
    }

    async def test(http, engine):
        got = {field: await http.post("/v1/completions", json=body) for field, body in bodies.items()}
        chat = {"messages": ASK, "tools": [_tool({})], "tool_choice": _named(huge)}
        got["tool_choice"] = await http.post("/v1/chat/completions", json=chat)
        return got

    got = with_client(model_folders["llama"], test, raw=True)
    for field, response in got.items():
        assert response.status_code == (404 if field == "model" else 400), field
        assert len(response.content) <= BOUND, (field, len(response.content))
        error = response.json()["error"]
        assert field in error["message"], error
        if field != "model":
            assert error["param"] == field
    stop = got["stop"].json()["error"]["message"]  # the list's start, and how long it was
    assert "['s0', 's1'" in stop and "10000 items" in stop


def test_a_stop_string_at_the_length_limit_is_served_and_one_past_it_is_a_400(model_folders):
    async def test(client, engine):
        at_limit = await client.completions.create(
            model="tiny",
            prompt="a",
            max_tokens=3,
            stop=["z" * MAX_STOP_CHARS],
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.BadRequestError) as past:
            await client.completions.create(
                model="tiny", prompt="a", max_tokens=3, stop=["ok", "z" * 1_000_000]
            )
        return at_limit, past.value

    at_limit, past = with_client(model_folders["llama"], test)
    assert at_limit.choices[0].finish_reason == "length"
    assert past.body["param"] == "stop" and "stop[1] has 1000000" in past.body["message"]
    assert len(past.response.content) <= BOUND
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=["z" * (MAX_STOP_CHARS + 1)])


@pytest.mark.parametrize(
    ("schema", "finite"),
    [
        ({"$ref": "#"}, False),
        (SELF_OBJECT, False),
        (SELF_ARRAY, False),
        ({"$defs": {"n": {"$ref": "#/$defs/m"}, "m": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}, False),
        ({"anyOf": [{"$ref": "#"}, SELF_ARRAY]}, False),
        (False, False),
        ({"anyOf": [SELF_ARRAY, {"type": "integer"}]}, True),  # 1
        ({"type": "array", "items": {"$ref": "#"}}, True),  # []
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, True),  # {}
        ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),  # no type: 1 is a value
        ({"$defs": {"leaf": {"const": 3}}, "type": "array", "items": {"$ref": "#/$defs/leaf"}}, True),
    ],
)
def test_a_schema_has_a_finite_value_unless_every_value_contains_itself(schema, finite):
    """The oracle is the written-out value in each comment (or its absence: every candidate
    nests itself); jsonschema confirms each named value."""
    assert has_finite_value(schema) is finite


@pytest.mark.parametrize("value", [1, [], {}])
def test_the_finite_values_named_above_validate(value):
    schemas = {
        int: {"anyOf": [SELF_ARRAY, {"type": "integer"}]},
        list: {"type": "array", "items": {"$ref": "#"}},
        dict: {"type": "object", "properties": {"a": {"$ref": "#"}}},
    }
    jsonschema.validate(value, schemas[type(value)])


def test_schemas_without_a_finite_value_are_400s_naming_the_field_that_asked(model_folders):
    async def test(client, engine):
        refused = []
        for schema in ({"$ref": "#"}, SELF_OBJECT, SELF_ARRAY):
            rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="tiny", messages=ASK, response_format=rf)
            refused.append(e.value.body)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="tiny", messages=ASK, tools=[_tool(SELF_OBJECT)], tool_choice="required"
            )
        refused.append(e.value.body)
        served = await client.chat.completions.create(  # recursive, but `[]` ends it
            model="tiny",
            messages=ASK,
            max_tokens=60,
            seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": LIST}},
        )
        return refused, served

    refused, served = with_client(model_folders["llama"], test)
    assert [r["param"] for r in refused] == ["response_format"] * 3 + ["tools"]
    assert all("no finite JSON value" in r["message"] for r in refused)
    (choice,) = served.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), LIST)


def test_a_tool_schema_error_names_the_tool_and_quotes_no_grammar(model_folders):
    async def test(client, engine):
        tools = [_tool({"type": "object"}), _tool({"$ref": "#/nope"}, name="broken")]
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="tiny", messages=ASK, tools=tools, tool_choice="required"
            )
        return e.value.body

    error = with_client(model_folders["llama"], test)
    assert error["param"] == "tools"
    assert error["message"].startswith("tools[1].function.parameters does not compile")
    assert "/nope" in error["message"]
    internals = ("%json", "start:", "<tool_call>", "x-guidance")
    assert not any(text in error["message"] for text in internals)


def test_a_matcher_that_errs_mid_request_fails_it_instead_of_finishing_it(small_llama_engine, monkeypatch):
    """Fault injection: the compile-time checks are switched off, so `{"$ref": "#"}` reaches the
    sampler, whose matcher errs on the first mask. The request must fail, never end as "stop"
    with text the grammar did not complete (the 200 with `""` of the issue)."""
    monkeypatch.setattr(grammar, "has_finite_value", lambda schema: True)
    monkeypatch.setattr(grammar, "_first_mask_fails", lambda matcher, vocab: False)
    spec = StructuredOutputs(json='{"$ref": "#", "title": "unchecked"}')
    with pytest.raises(RequestError):
        small_llama_engine.generate("a", SamplingParams(max_tokens=8, structured_outputs=spec))
    small_llama_engine.check_invariants()
    assert small_llama_engine.kv.num_live_tables() == 0  # its blocks went back


def _tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}
