"""The two generation endpoints, from a checked body to a response, whole or as Server-Sent Events.

The path of a request: authorize, parse (strict types), refuse unsupported fields and unknown
models, build the prompt ids (chat: the template with known replies spliced in), build the
engine params (a ValueError names the field: 400), admit (503 when full), run. A non-streamed
request races its client: when the client disconnects first, the work is cancelled, which aborts
its engine requests. A streamed request is ended the same way by Starlette, which cancels the
stream when the client disconnects (`_EventStream` then releases it). The admission count is
released on every path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.errors import RequestError
from radixkv.server.chat_prompt import chat_prompt_ids
from radixkv.server.errors import APIError, engine_param
from radixkv.server.generation import ChoiceStreams, Finished, run_beam_search, run_sampling
from radixkv.server.params import beam_params, max_tokens, renames, sampling_params
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.responses import Choice, Formatter
from radixkv.server.state import ServerState

log = logging.getLogger("radixkv.server")

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left


async def create(
    state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest
) -> Response:
    body.check_supported()
    state.check_model(body.model)
    chat = isinstance(body, ChatCompletionRequest)
    engine = state.engine
    if chat:
        prompts = [chat_prompt_ids(engine.tokenizer, body.messages, state.replies)]
        default = max(1, engine.max_model_len - len(prompts[0]))
    else:
        prompts = [_prompt_ids(engine, p) for p in body.prompts]
        default = COMPLETIONS_MAX_TOKENS
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    echo = not chat and body.echo
    fmt = Formatter(
        request_id, chat, state.model_name, engine.tokenizer, body.return_tokens_as_token_ids,
        echo=echo, echo_top=body.logprobs if echo else None, prompt_top=body.prompt_logprobs,
    )
    tokens = max_tokens(body, default)
    try:
        if body.stream:
            if body.n > engine.config.max_num_seqs:  # as the engine refuses n > max_num_seqs unstreamed
                raise ValueError(f"n {body.n} exceeds max_num_seqs {engine.config.max_num_seqs}")
            seed = body.seed
            streams = ChoiceStreams.open(
                engine,
                prompts,
                lambda i: sampling_params(body, tokens, n=1, seed=None if seed is None else seed + i),
                body.n,
                request_id,
                body.session_id,
            )
        else:
            params = beam_params(body, tokens) if body.use_beam_search else sampling_params(body, tokens)
    except ValueError as e:
        raise APIError.bad_request(engine_param(str(e), renames(body)), str(e)) from e
    count = len(prompts) * (body.n if body.stream else 1)
    state.admit(count, body.session_id)
    if body.stream:
        events = _events(state, streams, fmt, body.include_usage, chat, continuous=body.continuous_usage)

        async def end_stream() -> None:
            state.release(count, body.session_id)
            await streams.aclose()

        return _EventStream(events, end_stream)
    run = run_beam_search if body.use_beam_search else run_sampling
    work = run(engine, prompts, params, request_id, body.session_id)
    try:
        finished = await _unless_disconnected(request, _engine_errors(work, body))
    finally:
        state.release(count, body.session_id)
    if finished is None:
        log.info("%s: the client disconnected; its requests were aborted", request_id)
        return Response(status_code=499)
    if chat and state.replies is not None:
        for choice in finished.choices:
            state.replies.add(choice.text, choice.token_ids)
    return JSONResponse(fmt.response(finished.choices, finished.usage))


def _prompt_ids(engine: Any, prompt: str | list[int]) -> str | list[int]:
    """Text is tokenized here as the engine would (so the stream's usage knows its length);
    ids and text for a model without a tokenizer go to the engine as they are."""
    if isinstance(prompt, str) and prompt and engine.tokenizer is not None:
        return engine.tokenizer.encode(prompt, add_special_tokens=False)
    return prompt


async def _engine_errors(work: Awaitable[Finished], body: Any) -> Finished:
    """Engine errors as API errors: a ValueError names the field (400), a failed step is a 500."""
    try:
        return await work
    except ValueError as e:
        raise APIError.bad_request(engine_param(str(e), renames(body)), str(e)) from e
    except RequestError as e:
        raise APIError(500, str(e), type="server_error", code="engine_step_failed") from e


async def _unless_disconnected(request: Request, work: Awaitable[Finished]) -> Finished | None:
    """`work`'s result, or None (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        task.cancel()
        gone.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(
    state: ServerState,
    streams: ChoiceStreams,
    fmt: Formatter,
    include_usage: bool,
    chat: bool,
    *,
    continuous: bool = False,
) -> AsyncIterator[str]:
    """The SSE body: a chunk per piece of text (or per token, with logprobs), each with the
    usage so far when `continuous`, then the usage chunk if asked for, then `[DONE]`. An engine
    failure mid-stream is sent as an error event."""
    opened: set[int] = set()
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    try:
        async for index, delta in streams:
            texts.setdefault(index, []).append(delta.text)
            reply = ids.setdefault(index, [])
            if delta.token_id is not None:  # None: a closing delta, no token
                reply.append(delta.token_id)
            if not delta.text and delta.finish_reason is None and delta.logprobs is None:
                continue  # held back (part of a character, or maybe a stop string)
            choice = Choice(index, delta.text, delta.finish_reason, delta.logprobs)
            chunk = fmt.chunk(choice, first=chat and index not in opened)
            if continuous:
                chunk["usage"] = streams.usage.as_dict()
            yield _sse(chunk)
            opened.add(index)
        if include_usage:
            yield _sse(fmt.usage_chunk(streams.usage))
        yield "data: [DONE]\n\n"
        if chat and state.replies is not None:
            for index, pieces in texts.items():
                state.replies.add("".join(pieces), ids[index])
    except RequestError as e:
        error = APIError(500, str(e), type="server_error", code="engine_step_failed")
        yield _sse(error.body())


class _EventStream(StreamingResponse):
    """An SSE response that runs `end` (release the admission, abort what still runs) however it
    ends: sent whole, failed, or cancelled when its client disconnects. The body generator's own
    `finally` is not enough: Starlette cancels a stream whose client is already gone before the
    generator starts, and a generator that never started never runs its `finally`."""

    def __init__(self, events: AsyncIterator[str], end: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._end = end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._end()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
