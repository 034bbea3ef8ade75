"""A request's body as the engine's `SamplingParams` or `BeamSearchParams`.

The engine checks every range (one place decides what is valid); its ValueError becomes a 400
naming the request's parameter (`errors.engine_param`). Beam search (`use_beam_search`, `n`
beams) takes no sampling-only field: stop strings, stop token ids and logprobs are refused
with their names rather than ignored.
"""

from __future__ import annotations

from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.server.errors import APIError
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest

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


def sampling_params(body: Body, tokens: int, n: int | None = None, seed: int | None = None) -> SamplingParams:
    """The body's sampling, for `n` samples (default the body's) with `seed` (default the body's).
    Raises ValueError naming an engine field."""
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
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as strings) with int keys; ValueError naming it."""
    if bias is None:
        return None
    bad = next((key for key in bias if not key.isdigit()), None)
    if bad is not None:
        raise ValueError(f"logit_bias keys must be token ids written as strings, got {bad!r}")
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
