"""The request bodies of the OpenAI API as radixkv serves them, checked before the engine sees them.

Types are strict (a string where a number belongs, `true` where an integer belongs, a fractional
float where an integer belongs: all refused; an integral float such as `1.0` is taken as its integer,
as vLLM does), and integers are bounded by int64 (`n` at least 1, `seed` by what a generator takes),
so a malformed body fails here with the field named, never inside an engine step. Ranges are the
engine's own (`SamplingParams.validate`), checked at submission and mapped to a 400 naming the
parameter (`radixkv.server.errors`), so there is one place that decides what is in range. OpenAI
fields radixkv does not implement are accepted at their default values and refused with a 400
naming them otherwise, rather than silently ignored; unknown fields are ignored, as OpenAI's own
server does.

Extras beside OpenAI's fields, spelled as vLLM spells them: `top_k`, `ignore_eos`,
`stop_token_ids`, `use_beam_search` (with `n` beams, `length_penalty`, `early_stopping`),
`return_tokens_as_token_ids` (logprob tokens as "token_id:N"), `session_id` (the request is
a turn of that chat session, for the `session` eviction policy; `radixkv.server.sessions`),
`cache_salt` (the request shares cached blocks only with requests of the same salt), and
`structured_outputs` (with its older spellings `guided_json`, `guided_regex`, `guided_choice`).
The checks that need the whole body (`check_supported`) run as it is parsed. Structured output
(`response_format` too) and tools are turned into engine params by `radixkv.server.engine_inputs`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from radixkv.excerpt import excerpt
from radixkv.sampling_params import INT64_MAX, SEED_RANGE
from radixkv.server.errors import APIError


def _integral(value: object) -> object:
    """An integral float (`1.0`) as the integer it spells, as vLLM takes it; everything else goes
    on to strict validation, which refuses `1.5`, `true` and `"1"` naming the field."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int64 = Annotated[int, BeforeValidator(_integral), Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
"""An integer field: int64 at most, so nothing overflows a tensor inside a step."""
Count = Annotated[int, BeforeValidator(_integral), Field(ge=1, le=INT64_MAX)]
Seed = Annotated[int, BeforeValidator(_integral), Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


class _Part(BaseModel):
    """A part of a body: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(_Part):
    """OpenAI's `response_format`: `text`, `json_object`, or `json_schema` with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one of `json` (a schema), `regex`, `choice`,
    `json_object`, `grammar` (a Lark grammar in llguidance's dialect)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None


class _Common(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: Count = 1
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token ids as strings, as OpenAI spells them
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    # Extras.
    top_k: Int64 = -1
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    return_tokens_as_token_ids: bool = False
    session_id: str | None = Field(default=None, min_length=1, max_length=256)  # see server.sessions
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # a cache namespace
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens (whole responses)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None  # vLLM's older spellings of `structured_outputs`
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        """At the door, as the body is parsed: `check_supported` (an `APIError` is no
        `ValueError`, so pydantic lets it through as it is: a 400 naming the field)."""
        self.check_supported()
        return self

    def check_supported(self) -> None:
        """Raises a 400 naming the first field set to something radixkv cannot honour."""
        if self.stream_options is not None and not self.stream:
            raise APIError.bad_request("stream_options", "stream_options needs stream: true")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError.bad_request("prompt_logprobs", "prompt_logprobs needs stream: false")
        if self.use_beam_search and self.stream:
            raise APIError.bad_request(
                "stream", "beam search returns finished beams only: set stream to false"
            )


class CompletionRequest(_Common):
    """`POST /v1/completions`. `prompt` is text, token ids, or a list of either (a batch: one
    choice list per prompt, choice `index` running over prompts then samples, as OpenAI does).
    `logprobs` k returns each token's logprob and its k most likely alternatives. `echo` with
    `max_tokens: 0` scores the prompt: its text and logprobs, nothing generated (elsewhere
    `max_tokens` is at least 1)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None

    def check_supported(self) -> None:
        if self.echo and self.stream:
            raise APIError.bad_request("echo", "echo needs stream: false")
        if self.suffix:
            raise APIError.bad_request("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError.bad_request("best_of", "best_of is not supported (use n, or use_beam_search)")
        super().check_supported()


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Part):
    """An assistant message's earlier tool call, sent back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message; `content` given as text parts is their text joined, as templates take it."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers

    @field_validator("content", mode="after")
    @classmethod
    def _joined(cls, content: str | list[TextPart] | None) -> str | None:
        return "".join(part.text for part in content) if isinstance(content, list) else content


class FunctionDef(_Part):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; None: no arguments
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    """`POST /v1/chat/completions`: `messages` through the model's chat template. `logprobs`
    true returns each token's logprob, with `top_logprobs` alternatives. `tools` are rendered
    by the chat template and their calls parsed from the reply (`radixkv.server.tools`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def check_supported(self) -> None:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError.bad_request("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
            t.function.name for t in self.tools
        }:
            raise APIError.bad_request(
                "tool_choice",
                f"tool_choice names {excerpt(self.tool_choice.function.name)}, which is not in tools",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs", "top_logprobs needs logprobs: true")
        super().check_supported()
