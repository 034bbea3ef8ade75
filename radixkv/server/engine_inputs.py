"""A request body as the engine's inputs, in one pass: the prompts (chat through its template,
in a worker thread: `chat_prompt.render`), the engine params (`SamplingParams`, one a sample when
streamed, or `BeamSearchParams`), the grammar a structured answer or a forced tool call follows,
and what the answer's shape needs later. `prepare` is the endpoints' one call here; everything
it needs of the body it reads here, and nothing here formats an answer.

The engine checks every range (one place decides what is valid); its ValueError becomes a 400
naming the request's parameter (`errors.engine_param`, with this endpoint's `renames`). Beam
search (`use_beam_search`, `n` beams) takes no sampling-only field: stop strings, stop token ids
and logprobs are refused with their names rather than ignored. Templates and tokenization run in
worker threads, after a length check that needs neither: the event loop stays free for every
other client however long a prompt is.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixkv.excerpt import excerpt
from radixkv.sampling_params import BeamSearchParams, SamplingParams, sample_seed
from radixkv.server import chat_prompt
from radixkv.server.errors import APIError, engine_param
from radixkv.server.generation import Tags
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, Tool
from radixkv.server.state import ServerState
from radixkv.server.tools import CLOSE, OPEN
from radixkv.structured import StructuredOutputs
from radixkv.structured.grammar import GrammarError

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left


@dataclass(slots=True)
class Inputs:
    """What `prepare` makes of a body: the engine's inputs, and what its answer needs."""

    chat: bool
    request_id: str
    prompts: list[Any]  # token ids (text only for a model without a tokenizer)
    tags: Tags
    params: SamplingParams | BeamSearchParams | None  # a whole answer's
    per_sample: list[SamplingParams] | None  # a stream's: one engine request a sample
    sequences: int  # what the request makes wait for a slot: its prompts times n
    admit_param: str  # the field to blame when that alone is too many
    scoring: bool  # completions `echo` with `max_tokens: 0`: one token made, then dropped
    tools: bool  # the reply's tool calls are parsed out of it
    max_calls: int | None  # at most this many (None: any)
    named: str | None  # the function `tool_choice` names
    include_usage: bool
    continuous_usage: bool
    echo: bool
    echo_top: int | None
    prompt_top: int | None
    as_token_ids: bool  # `return_tokens_as_token_ids`


async def prepare(state: ServerState, body: Body, namespace: str | None) -> Inputs:
    """`body`'s engine inputs, in cache namespace `namespace` (`ServerState.cache_salt`).
    Raises `APIError`: a 400 naming the field for what the engine would refuse."""
    engine = state.engine
    chat = isinstance(body, ChatCompletionRequest)
    asked = None if body.use_beam_search else structured(body)  # beam_params refuses it
    if asked is not None:
        await _compile(engine, asked)
    spec = asked.spec if asked is not None else None
    tags = Tags(body.session_id, namespace)
    limit = (state.max_prompt_chars, engine.max_model_len)
    if chat:
        tools = body.tools if body.tools and body.tool_choice != "none" else None
        render = (chat_prompt.render, engine.tokenizer, body.messages, state.replies, namespace, tools, limit)
        ids, shown = await asyncio.to_thread(*render)
        prompts, default = [ids], max(1, engine.max_model_len - len(ids))
    else:
        shown = None
        prompts = prompt_batch(body)
        for p in prompts:
            if isinstance(p, str) and limit[0] is not None and len(p) > limit[0]:
                raise APIError.text_too_long("prompt", len(p), limit[1])
        prompts = await asyncio.to_thread(lambda: [_prompt_ids(engine, p) for p in prompts])
        default = COMPLETIONS_MAX_TOKENS
    echo = not chat and body.echo
    tokens = max_tokens(body, default)
    scoring = echo and tokens == 0
    if scoring:
        if body.min_tokens:
            raise APIError.bad_request("min_tokens", "min_tokens needs max_tokens of at least min_tokens")
        tokens = 1
    params = per_sample = None
    try:
        if body.stream:
            if body.n > engine.config.max_num_seqs:  # as the engine refuses n > max_num_seqs unstreamed
                raise ValueError(f"n {body.n} exceeds max_num_seqs {engine.config.max_num_seqs}")
            seeds = [None if body.seed is None else sample_seed(body.seed, i) for i in range(body.n)]
            per_sample = [sampling_params(body, tokens, n=1, seed=s, spec=spec) for s in seeds]
        elif body.use_beam_search:
            params = beam_params(body, tokens)
        else:
            params = sampling_params(body, tokens, spec=spec)
    except ValueError as e:
        raise APIError.bad_request(engine_param(str(e), renames(body)), str(e)) from e
    options = body.stream_options
    return Inputs(
        chat=chat,
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        prompts=prompts,
        tags=tags,
        params=params,
        per_sample=per_sample,
        sequences=len(prompts) * body.n,
        admit_param="n" if body.n > 1 else "prompt",
        scoring=scoring,
        tools=shown is not None,
        max_calls=None if shown is None or body.parallel_tool_calls else 1,
        named=body.tool_choice.function.name
        if chat and isinstance(body.tool_choice, NamedToolChoice)
        else None,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
        echo=echo,
        echo_top=body.logprobs if echo else None,
        prompt_top=body.prompt_logprobs,
        as_token_ids=body.return_tokens_as_token_ids,
    )


def prompt_batch(body: CompletionRequest) -> list[str | list[int]]:
    """The batch: one prompt per entry. An empty list is one empty prompt (the engine says why)."""
    p = body.prompt
    if isinstance(p, str) or not p or isinstance(p[0], int):
        return [p]
    return list(p)


def _prompt_ids(engine: Any, prompt: str | list[int]) -> str | list[int]:
    """Text is tokenized here as the engine would (so the stream's usage knows its length);
    ids and text for a model without a tokenizer go to the engine as they are."""
    if isinstance(prompt, str) and prompt and engine.tokenizer is not None:
        return engine.tokenizer.encode(prompt, add_special_tokens=False)
    return prompt


async def _compile(engine: Any, asked: Structured) -> None:
    """Compiles (and so caches, for the engine) the body's grammar in a worker thread: an
    invalid schema, regex or grammar is a 400 naming the field that asked for it. A tool's
    schema is compiled alone first, so its error is a 400 naming `tools` and the schema, in
    the user's terms; the tool-call grammar around it is the server's and is never quoted."""
    for where, part in asked.parts:
        try:
            await asyncio.to_thread(engine.grammars.check, part)
        except GrammarError as e:
            raise APIError.bad_request("tools", f"{where} does not compile: {e.reason}") from e
    try:
        await asyncio.to_thread(engine.grammars.check, asked.spec)
    except GrammarError as e:
        raise APIError.bad_request(asked.field, f"{asked.field} does not compile: {e.reason}") from e
    except ValueError as e:
        raise APIError.bad_request(asked.field, str(e)) from e


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
    `tool_choice` of `required` or a named function (`forced_grammar`). Two at once is a 400
    naming the second."""
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
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
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


def forced_grammar(tools: list[Tool], choice: str | NamedToolChoice) -> str:
    """The Lark grammar (llguidance's, `%json` embedding a schema) of one call: to the named
    function, or with `required` to any of `tools`."""
    chosen = [
        t for t in tools if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name
    ]
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object", "properties": {}},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = {"whitespace_flexible": False}
    return f"start: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}"
