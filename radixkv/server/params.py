"""A request's body as the engine's `SamplingParams` or `BeamSearchParams`.

The engine checks every range (one place decides what is valid); its ValueError becomes a 400
naming the request's parameter (`errors.engine_param`). Beam search (`use_beam_search`, `n`
beams) takes no sampling-only field: stop strings, stop token ids and logprobs are refused
with their names rather than ignored.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from radixkv.excerpt import excerpt
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.server.errors import APIError
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.tools import forced_grammar
from radixkv.structured import StructuredOutputs

Body = CompletionRequest | ChatCompletionRequest


def max_tokens(body: Body, default: int) -> int:
    """`max_completion_tokens` (OpenAI's newer name) if given, else `max_tokens`, else `default`."""
    given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return default if given is None else given


def num_logprobs(body: Body) -> int | None:
    """Alternatives per token for the engine's `logprobs`, or None when not asked for."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def num_prompt_logprobs(body: Body) -> int | None:
    """Alternatives per prompt token for the engine's `prompt_logprobs`: vLLM's field, or the
    `logprobs` of a completions `echo`, whichever asks more; None when neither asks."""
    wanted = [body.prompt_logprobs]
    if isinstance(body, CompletionRequest) and body.echo:
        wanted.append(body.logprobs)
    asked = [k for k in wanted if k is not None]
    return max(asked) if asked else None


def renames(body: Body) -> dict[str, str]:
    """Engine field names that this endpoint spells otherwise (see `errors.engine_param`)."""
    names = {}
    if body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    if isinstance(body, ChatCompletionRequest):
        names.update(prompt="messages", logprobs="top_logprobs")
    return names


class Structured(NamedTuple):
    """`spec`, asked for by body field `field` (named by a 400). `parts` are the user's own
    schemas inside a spec the server wrote (each tool's `parameters` in a tool-call grammar),
    each with where it sits in the body: they are compiled first, so an error names the
    schema the user wrote, never the grammar built around it."""

    spec: StructuredOutputs
    field: str
    parts: tuple[tuple[str, StructuredOutputs], ...] = ()


def structured(body: Body) -> Structured | None:
    """What the body's output must match, from whichever one field asks: `response_format`
    (json_object, json_schema), vLLM's `structured_outputs` or its older `guided_*`, or a chat
    `tool_choice` of `required` or a named function (`tools.forced_grammar`). Two at once is a
    400 naming the second."""
    asked: list[Structured] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(Structured(StructuredOutputs(json_object=True), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError.bad_request("response_format", "response_format json_schema needs json_schema")
        schema = rf.json_schema.schema_
        spec = StructuredOutputs(json_object=True)
        if schema is not None:
            spec = StructuredOutputs(json=json.dumps(schema))
        asked.append(Structured(spec, "response_format"))
    so = body.structured_outputs
    if so is not None:
        schema = so.json_ if so.json_ is None or isinstance(so.json_, str) else json.dumps(so.json_)
        spec = StructuredOutputs(
            json=schema,
            json_object=bool(so.json_object),
            regex=so.regex,
            choice=so.choice,
            grammar=so.grammar,
        )
        asked.append(Structured(spec, "structured_outputs"))
    if body.guided_json is not None:
        schema = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        asked.append(Structured(StructuredOutputs(json=schema), "guided_json"))
    if body.guided_regex is not None:
        asked.append(Structured(StructuredOutputs(regex=body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        asked.append(Structured(StructuredOutputs(choice=body.guided_choice), "guided_choice"))
    chat = isinstance(body, ChatCompletionRequest)
    if chat and body.tools and body.tool_choice not in (None, "auto", "none"):
        grammar = forced_grammar(body.tools, body.tool_choice)
        parts = tuple(
            (f"tools[{i}].function.parameters", StructuredOutputs(json=json.dumps(t.function.parameters)))
            for i, t in enumerate(body.tools)
            if t.function.parameters is not None
        )
        asked.append(Structured(StructuredOutputs(grammar=grammar), "tool_choice", parts))
    if len(asked) > 1:
        first, second = asked[0].field, asked[1].field
        raise APIError.bad_request(second, f"{second} cannot be combined with {first}")
    if asked:
        try:
            asked[0].spec.validate()
        except ValueError as e:
            raise APIError.bad_request(asked[0].field, str(e)) from e
    return asked[0] if asked else None


def sampling_params(
    body: Body,
    tokens: int,
    n: int | None = None,
    seed: int | None = None,
    spec: StructuredOutputs | None = None,
) -> SamplingParams:
    """The body's sampling, for `n` samples (default the body's) with `seed` (default the body's),
    following `spec` (see `structured`). Raises ValueError naming an engine field."""
    return SamplingParams(
        max_tokens=tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed if seed is None else seed,
        n=body.n if n is None else n,
        ignore_eos=body.ignore_eos,
        stop_token_ids=list(body.stop_token_ids or []),
        stop=body.stop_strings,
        logprobs=num_logprobs(body),
        prompt_logprobs=num_prompt_logprobs(body),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        min_p=body.min_p,
        min_tokens=body.min_tokens,
        structured_outputs=spec,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as strings) with int keys; ValueError naming it."""
    if bias is None:
        return None
    bad = next((key for key in bias if not key.isdigit()), None)
    if bad is not None:
        raise ValueError(f"logit_bias keys must be token ids written as strings, got {excerpt(bad)}")
    return {int(key): value for key, value in bias.items()}


SAMPLING_ONLY = {  # body fields beam search cannot honour, with their off values
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "min_p": 0.0,
    "min_tokens": 0,
}


def beam_params(body: Body, tokens: int) -> BeamSearchParams:
    """`n` beams. Raises APIError for a sampling-only field, ValueError naming an engine field."""
    for name, value in (("stop", body.stop), ("stop_token_ids", body.stop_token_ids)):
        if value:
            raise APIError.bad_request(name, f"{name} is not supported with use_beam_search")
    for name, off in SAMPLING_ONLY.items():
        if getattr(body, name) not in (off, {}):
            raise APIError.bad_request(name, f"{name} is not supported with use_beam_search")
    asked = structured(body)
    if asked is not None:
        raise APIError.bad_request(asked.field, f"{asked.field} is not supported with use_beam_search")
    if num_logprobs(body) is not None or num_prompt_logprobs(body) is not None:
        name = "logprobs" if num_logprobs(body) is not None else "prompt_logprobs"
        raise APIError.bad_request(name, f"{name} is not supported with use_beam_search")
    return BeamSearchParams(
        beam_width=body.n,
        max_tokens=tokens,
        length_penalty=body.length_penalty,
        early_stopping=body.early_stopping,
        ignore_eos=body.ignore_eos,
    )
