"""The two generation endpoints, from a checked body to a response, whole or as Server-Sent Events.

The path of a request: at the door (`app`), authorize, parse (strict types, unsupported fields
refused), refuse unknown models, and find its cache namespace; here, its engine inputs in one
pass (`engine_inputs.prepare`: the prompt ids, the chat template with known replies spliced in,
the engine params; a ValueError names the field: 400), admit (503 when full), run, and format
the answer (`responses.Formatter`, made once the engine has the request). A non-streamed
request races its client: when the client disconnects first, the work is cancelled, which aborts
its engine requests. A streamed request is ended the same way by Starlette, which cancels the
stream when the client disconnects (`EventStream` then releases it). The admission count is
released on every path.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.errors import EngineDeadError, RequestError
from radixkv.server.engine_inputs import Inputs, prepare, renames
from radixkv.server.errors import APIError, engine_param
from radixkv.server.generation import ChoiceStreams, Finished, run_beam_search, run_sampling
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.request_ids import request_id as scope_request_id
from radixkv.server.responses import Choice, Formatter
from radixkv.server.state import ServerState
from radixkv.server.tools import ToolStream
from radixkv.server.tools import parse as parse_tool_calls

log = logging.getLogger("radixkv.server")


class Streamed(NamedTuple):
    """A streamed answer before it is sent: its chunks (dicts, or `DONE` last) and what must run
    however the stream ends (`EventStream`)."""

    chunks: AsyncIterator[dict[str, Any] | str]
    end: Callable[[], Awaitable[None]]


DONE = "[DONE]"


async def create(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    namespace: str | None = None,
) -> Response:
    """`namespace`: the request's cache namespace (`ServerState.cache_salt` of its key and body)."""
    answer = await run(state, request, body, namespace)
    if isinstance(answer, Streamed):
        return EventStream(_sse_lines(answer.chunks), answer.end)
    return answer if isinstance(answer, Response) else JSONResponse(answer)


async def run(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    namespace: str | None = None,
) -> dict[str, Any] | Streamed | Response:
    """The answer to `body`: the whole body, a stream of chunks not yet sent, or (the client went
    away) a bare 499. Other endpoints that translate to these two (`/v1/responses`) reshape it."""
    engine = state.engine
    if not engine.is_alive():
        raise APIError.engine_dead()
    inputs = await prepare(state, body, namespace)
    if body.stream:
        try:
            streams = ChoiceStreams.open(
                engine, inputs.prompts, inputs.per_sample, inputs.request_id, inputs.tags
            )
        except ValueError as e:
            raise APIError.bad_request(engine_param(str(e), renames(body)), str(e)) from e
        state.admit(inputs.sequences, body.session_id, param=inputs.admit_param)

        async def end_stream() -> None:
            state.release(inputs.sequences, body.session_id)
            await streams.aclose()

        return Streamed(_events(state, streams, _formatter(state, inputs), inputs, request.scope), end_stream)
    state.admit(inputs.sequences, body.session_id, param=inputs.admit_param)
    run = run_beam_search if body.use_beam_search else run_sampling
    work = run(engine, inputs.prompts, inputs.params, inputs.request_id, inputs.tags)
    try:
        checked = _engine_errors(work, body, request.scope)
        finished = await _unless_disconnected(request, checked)
    finally:
        state.release(inputs.sequences, body.session_id)
    if finished is None:
        log.info("%s: the client disconnected; its requests were aborted", inputs.request_id)
        return Response(status_code=499)
    if inputs.scoring:
        _drop_generated(finished)
    if inputs.chat and state.replies is not None:
        for choice in finished.choices:
            state.replies.add(choice.text, choice.token_ids, inputs.tags.cache_salt)
    if inputs.tools:
        for choice in finished.choices:
            _take_tool_calls(choice, inputs.max_calls, inputs.named)
    return _formatter(state, inputs).response(finished.choices, finished.usage)


def _formatter(state: ServerState, inputs: Inputs) -> Formatter:
    """The answer's formatter, made once the engine has the request."""
    return Formatter(
        inputs.request_id,
        inputs.chat,
        state.model_name,
        state.engine.tokenizer,
        inputs.as_token_ids,
        echo=inputs.echo,
        echo_top=inputs.echo_top,
        prompt_top=inputs.prompt_top,
    )


def _drop_generated(finished: Finished) -> None:
    """Completions `echo` with `max_tokens: 0` (prompt scoring, as lm-eval's loglikelihood asks):
    the engine cannot make no token, so it made one; the answer keeps the prompt only, with no
    generated text, logprobs or usage, and finishes with "length" (the budget was 0), as the legacy
    OpenAI API and vLLM answer."""
    for choice in finished.choices:
        choice.text, choice.token_ids, choice.finish_reason = "", [], "length"
        if choice.logprobs is not None:
            choice.logprobs = []
    finished.usage.completion_tokens = 0


def _take_tool_calls(choice: Choice, max_calls: int | None, named: str | None) -> None:
    """The reply's tool calls out of its text (`tools.parse`, at most `max_calls`; a reply cut
    by `max_tokens` keeps its partial call and finishes with "length"); a reply that made calls
    and was not cut short finishes with "tool_calls"."""
    cut = choice.finish_reason == "length"
    parsed = parse_tool_calls(choice.text, max_calls, cut=cut, named=named)
    if parsed.calls or (cut and parsed.content != (choice.text.strip() or None)):  # markup dropped
        choice.text, choice.tool_calls = parsed.content, parsed.calls
        if choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"


async def _engine_errors(work: Awaitable[Finished], body: Any, scope: Any) -> Finished:
    """Engine errors as API errors: a ValueError names the field (400), a failed step is a 500
    (its cause logged under the id of the HTTP request of ASGI `scope`, not sent), a dead engine
    a 503."""
    try:
        return await work
    except ValueError as e:
        raise APIError.bad_request(engine_param(str(e), renames(body)), str(e)) from e
    except RequestError as e:
        if isinstance(e.__cause__, EngineDeadError):  # the core died under it
            raise APIError.engine_dead() from e
        raise _step_failed(e, scope_request_id(scope)) from e
    except EngineDeadError as e:
        raise APIError.engine_dead() from e


def _step_failed(error: RequestError, rid: str) -> APIError:
    """The client's side of a failed step: its type and the request id; the cause (whose text may
    hold anything) goes to the log only."""
    log.warning("request %s: an engine step failed under it", rid, exc_info=error)
    cause = type(error.__cause__).__name__ if error.__cause__ is not None else "RequestError"
    return APIError(
        500,
        f"the engine step running this request failed ({cause}); quote request id {rid}",
        type="server_error",
        code="engine_step_failed",
    )


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
    state: ServerState, streams: ChoiceStreams, fmt: Formatter, inputs: Inputs, scope: Any
) -> AsyncIterator[dict[str, Any] | str]:
    """The SSE body's payloads: a chunk each time a choice's tokens come, with their text or their
    logprobs (one token's, or several when the front end lags behind the engine: `ChoiceStreams`), each
    with the usage so far when `continuous_usage`, then the usage chunk if asked for, then `[DONE]`.
    With `tools`, each choice's text goes through a `ToolStream`: content, and tool-call deltas. An
    engine failure mid-stream is sent as an error event, then `[DONE]`, as vLLM ends it; its log
    line has the id of the HTTP request of ASGI `scope`."""
    chat, tools, max_calls, named = inputs.chat, inputs.tools, inputs.max_calls, inputs.named
    opened: set[int] = set()
    parsers: dict[int, ToolStream] = {}
    texts: dict[int, list[str]] = {}
    ids: dict[int, list[int]] = {}
    try:
        async for index, deltas in streams:
            text = "".join(d.text for d in deltas)
            texts.setdefault(index, []).append(text)
            ids.setdefault(index, []).extend(d.token_id for d in deltas if d.token_id is not None)
            logprobs = [r for d in deltas for r in d.logprobs or ()] or None
            calls, finish = None, deltas[-1].finish_reason
            if tools:
                parser = parsers.setdefault(index, ToolStream(max_calls))
                piece = parser.feed(text)
                if finish is not None:
                    end = parser.finish(cut=finish == "length", named=named)
                    piece.content += end.content
                    piece.calls += end.calls
                    finish = "tool_calls" if parser.called and finish == "stop" else finish
                text, calls = piece.content, piece.calls or None
            if not text and not calls and finish is None and logprobs is None:
                continue  # held back (part of a character, or maybe a stop string or tool call)
            choice = Choice(index, text, finish, logprobs, tool_calls=calls)
            chunk = fmt.chunk(choice, first=chat and index not in opened)
            if inputs.continuous_usage:
                chunk["usage"] = streams.usage.as_dict()
            yield chunk
            opened.add(index)
        if inputs.include_usage:
            yield fmt.usage_chunk(streams.usage)
        yield DONE
        if chat and state.replies is not None:
            for index, pieces in texts.items():
                state.replies.add("".join(pieces), ids[index], inputs.tags.cache_salt)
    except RequestError as e:
        dead = isinstance(e.__cause__, EngineDeadError)  # the core died under it
        yield (APIError.engine_dead() if dead else _step_failed(e, scope_request_id(scope))).body()
        yield DONE
    except EngineDeadError:
        yield APIError.engine_dead().body()
        yield DONE


class EventStream(StreamingResponse):
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


async def _sse_lines(chunks: AsyncIterator[dict[str, Any] | str]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield f"data: {chunk}\n\n" if isinstance(chunk, str) else sse(chunk)


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One Server-Sent Event carrying `payload` as JSON, named `event` if given."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {json.dumps(payload, separators=(',', ':'))}\n\n"
