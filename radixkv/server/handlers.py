"""The two generation endpoints, from a checked body to a response, whole or as Server-Sent Events.

The path of a request: authorize, parse (strict types), refuse unsupported fields and unknown
models, build the prompt ids (chat: the template with known replies spliced in), build the
engine params (a ValueError names the field: 400), admit (503 when full), run. A non-streamed
request races its client: when the client disconnects first, the work is cancelled, which aborts
its engine requests. A streamed request is ended the same way by Starlette, which cancels the
stream when the client disconnects (`EventStream` then releases it). The admission count is
released on every path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.errors import EngineDeadError, RequestError
from radixkv.sampling_params import SamplingParams, sample_seed
from radixkv.server.chat_prompt import chat_prompt_ids
from radixkv.server.errors import APIError, engine_param
from radixkv.server.generation import ChoiceStreams, Finished, Tags, run_beam_search, run_sampling
from radixkv.server.params import Structured, beam_params, max_tokens, renames, sampling_params, structured
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from radixkv.server.request_ids import request_id as scope_request_id
from radixkv.server.responses import Choice, Formatter
from radixkv.server.state import ServerState
from radixkv.server.tools import ToolStream, template_tools
from radixkv.server.tools import parse as parse_tool_calls
from radixkv.structured.grammar import GrammarError

log = logging.getLogger("radixkv.server")

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left


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
    key: str | None = None,
) -> Response:
    """`key`: the API key the request came with (its cache namespace under per-key isolation)."""
    answer = await run(state, request, body, key)
    if isinstance(answer, Streamed):
        return EventStream(_sse_lines(answer.chunks), answer.end)
    return answer if isinstance(answer, Response) else JSONResponse(answer)


async def run(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    key: str | None = None,
) -> dict[str, Any] | Streamed | Response:
    """The answer to `body`: the whole body, a stream of chunks not yet sent, or (the client went
    away) a bare 499. Other endpoints that translate to these two (`/v1/responses`) reshape it."""
    body.check_supported()
    state.check_model(body.model)
    chat = isinstance(body, ChatCompletionRequest)
    engine = state.engine
    if not engine.is_alive():
        raise _engine_dead()
    asked = None if body.use_beam_search else structured(body)  # beam_params refuses it
    if asked is not None:
        await _compile(engine, asked)
    spec = asked.spec if asked is not None else None
    tools = template_tools(body.tools) if chat and body.tools and body.tool_choice != "none" else None
    tags = Tags(body.session_id, state.cache_salt(key, body.cache_salt))
    # Templates and tokenization run in worker threads, after a length check that needs neither:
    # the event loop stays free for every other client however long a prompt is.
    if chat:
        state.check_text_length(sum(len(m.text) for m in body.messages), "messages")
        render = (chat_prompt_ids, engine.tokenizer, body.messages, state.replies, tags.cache_salt, tools)
        prompts = [await asyncio.to_thread(*render)]
        default = max(1, engine.max_model_len - len(prompts[0]))
    else:
        for p in body.prompts:
            if isinstance(p, str):
                state.check_text_length(len(p), "prompt")
        prompts = await asyncio.to_thread(lambda: [_prompt_ids(engine, p) for p in body.prompts])
        default = COMPLETIONS_MAX_TOKENS
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    echo = not chat and body.echo
    fmt = Formatter(
        request_id,
        chat,
        state.model_name,
        engine.tokenizer,
        body.return_tokens_as_token_ids,
        echo=echo,
        echo_top=body.logprobs if echo else None,
        prompt_top=body.prompt_logprobs,
    )
    tokens = max_tokens(body, default)
    scoring = echo and tokens == 0  # prompt scoring: the engine makes one token, then it is dropped
    if scoring:
        if body.min_tokens:
            raise APIError.bad_request("min_tokens", "min_tokens needs max_tokens of at least min_tokens")
        tokens = 1
    try:
        if body.stream:
            if body.n > engine.config.max_num_seqs:  # as the engine refuses n > max_num_seqs unstreamed
                raise ValueError(f"n {body.n} exceeds max_num_seqs {engine.config.max_num_seqs}")
            seed = body.seed

            def sample_params(i: int) -> SamplingParams:
                return sampling_params(
                    body, tokens, n=1, seed=None if seed is None else sample_seed(seed, i), spec=spec
                )

            streams = ChoiceStreams.open(
                engine,
                prompts,
                sample_params,
                body.n,
                request_id,
                tags,
            )
        else:
            if body.use_beam_search:
                params = beam_params(body, tokens)
            else:
                params = sampling_params(body, tokens, spec=spec)
    except ValueError as e:
        raise APIError.bad_request(engine_param(str(e), renames(body)), str(e)) from e
    count = len(prompts) * body.n  # sequences: every prompt's samples or beams wait for a slot
    state.admit(count, body.session_id, param="n" if body.n > 1 else "prompt")
    if body.stream:
        events = _events(
            state,
            streams,
            fmt,
            body.include_usage,
            chat,
            scope_request_id(request.scope),
            tags,
            continuous=body.continuous_usage,
            tools=tools is not None,
            max_calls=None if tools is None or body.parallel_tool_calls else 1,
            named=_named(body) if tools is not None else None,
        )

        async def end_stream() -> None:
            state.release(count, body.session_id)
            await streams.aclose()

        return Streamed(events, end_stream)
    run = run_beam_search if body.use_beam_search else run_sampling
    work = run(engine, prompts, params, request_id, tags)
    try:
        checked = _engine_errors(work, body, scope_request_id(request.scope))
        finished = await _unless_disconnected(request, checked)
    finally:
        state.release(count, body.session_id)
    if finished is None:
        log.info("%s: the client disconnected; its requests were aborted", request_id)
        return Response(status_code=499)
    if scoring:
        _drop_generated(finished)
    if chat and state.replies is not None:
        for choice in finished.choices:
            state.replies.add(choice.text, choice.token_ids, tags.cache_salt)
    if tools is not None:
        for choice in finished.choices:
            _take_tool_calls(choice, None if body.parallel_tool_calls else 1, _named(body))
    return fmt.response(finished.choices, finished.usage)


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


def _named(body: ChatCompletionRequest) -> str | None:
    """The function a `tool_choice` names, if it names one."""
    return body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None


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


def _prompt_ids(engine: Any, prompt: str | list[int]) -> str | list[int]:
    """Text is tokenized here as the engine would (so the stream's usage knows its length);
    ids and text for a model without a tokenizer go to the engine as they are."""
    if isinstance(prompt, str) and prompt and engine.tokenizer is not None:
        return engine.tokenizer.encode(prompt, add_special_tokens=False)
    return prompt


async def _engine_errors(work: Awaitable[Finished], body: Any, rid: str) -> Finished:
    """Engine errors as API errors: a ValueError names the field (400), a failed step is a 500
    (its cause logged under the request id, not sent), a dead engine a 503."""
    try:
        return await work
    except ValueError as e:
        raise APIError.bad_request(engine_param(str(e), renames(body)), str(e)) from e
    except RequestError as e:
        if isinstance(e.__cause__, EngineDeadError):  # the core died under it
            raise _engine_dead() from e
        raise _step_failed(e, rid) from e
    except EngineDeadError as e:
        raise _engine_dead() from e


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


def _engine_dead() -> APIError:
    message = "the engine is not running; the server is going down"
    return APIError(503, message, type="server_error", code="engine_dead")


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
    rid: str,
    tags: Tags,
    *,
    continuous: bool = False,
    tools: bool = False,
    max_calls: int | None = None,
    named: str | None = None,
) -> AsyncIterator[dict[str, Any] | str]:
    """The SSE body's payloads: a chunk each time a choice's tokens come, with their text or their
    logprobs (one token's, or several when the front end lags behind the engine: `ChoiceStreams`), each
    with the usage so far when `continuous`, then the usage chunk if asked for, then `[DONE]`. With
    `tools`, each choice's text goes through a `ToolStream`: content, and tool-call deltas. An
    engine failure mid-stream is sent as an error event, then `[DONE]`, as vLLM ends it."""
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
            if continuous:
                chunk["usage"] = streams.usage.as_dict()
            yield chunk
            opened.add(index)
        if include_usage:
            yield fmt.usage_chunk(streams.usage)
        yield DONE
        if chat and state.replies is not None:
            for index, pieces in texts.items():
                state.replies.add("".join(pieces), ids[index], tags.cache_salt)
    except RequestError as e:
        dead = isinstance(e.__cause__, EngineDeadError)  # the core died under it
        yield (_engine_dead() if dead else _step_failed(e, rid)).body()
        yield DONE
    except EngineDeadError:
        yield _engine_dead().body()
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
