"""One HTTP request's engine work: its prompts times its samples, whole or streamed.
Every engine request of an HTTP request carrying `session_id` is tagged with it.

A completions batch is one engine request per prompt (`{id}-{j}`), all submitted together; a
stream runs one engine request per choice, since the engine streams n == 1. Sample `i` of a
seeded stream is seeded `seed + i` (wrapped to uint64), as the engine seeds its own `n` forks,
so a seeded request gives the same samples streamed or not. Every exit path ends the engine
requests still going: an error in one, a cancelled handler (the client went away) and a closed
stream all cancel the rest, and the engine aborts a request whose awaiting task is cancelled or
whose stream closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from radixkv.outputs import StreamDelta
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.server.responses import Choice, Usage

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Tags:
    """What every engine request of one HTTP request carries: its chat session (`session_id`)
    and its cache namespace (`cache_salt`)."""

    session_id: str | None = None
    cache_salt: str | None = None

    def engine_kwargs(self) -> dict[str, str | None]:
        return {"session_id": self.session_id, "cache_salt": self.cache_salt}


@dataclass(slots=True)
class Finished:
    choices: list[Choice]
    usage: Usage


async def gather_all(awaitables: list[Awaitable[T]]) -> list[T]:
    """All results, in order. If one fails or the caller is cancelled, the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def run_sampling(
    engine: Any, prompts: list[list[int]], params: SamplingParams, request_id: str, tags: Tags
) -> Finished:
    """Each prompt's `n` samples; choice `j * n + i` is prompt j's sample i."""
    outs = await gather_all(
        [
            engine.generate(p, params, request_id=f"{request_id}-{j}", **tags.engine_kwargs())
            for j, p in enumerate(prompts)
        ]
    )
    choices, usage = [], Usage()
    for j, out in enumerate(outs):
        for i, s in enumerate(out.samples):
            choices.append(
                Choice(
                    j * params.n + i,
                    s.text,
                    s.finish_reason,
                    s.logprobs,
                    s.token_ids,
                    out.prompt_token_ids,
                    out.prompt_logprobs,
                )
            )
            usage.completion_tokens += len(s.token_ids)
        usage.prompt_tokens += len(out.prompt_token_ids)
        usage.cached_tokens += out.num_cached_tokens
    return Finished(choices, usage)


async def run_beam_search(
    engine: Any, prompts: list[list[int]], params: BeamSearchParams, request_id: str, tags: Tags
) -> Finished:
    """Each prompt's `beam_width` best beams, best first; choice `j * width + i`."""
    results = await gather_all(
        [
            engine.beam_search(p, params, request_id=f"{request_id}-{j}", **tags.engine_kwargs())
            for j, p in enumerate(prompts)
        ]
    )
    choices, usage = [], Usage()
    for j, (prompt, beams) in enumerate(zip(prompts, results, strict=True)):
        for i, beam in enumerate(beams):
            choices.append(
                Choice(j * params.beam_width + i, beam.text, beam.finish_reason, None, beam.token_ids, prompt)
            )
            usage.completion_tokens += len(beam.token_ids)
        usage.prompt_tokens += len(prompt)
    return Finished(choices, usage)


class ChoiceStreams:
    """The streams of one request's choices, merged in the order their tokens come.

    Opening them (`open`) validates every one before any is submitted, so bad input is a 400
    before the response starts. Iterating yields `(index, deltas)`, one choice's deltas that
    came together (`__aiter__`); `usage` is complete once the iteration ends. `aclose` (or
    leaving the iteration) ends every stream still going.
    """

    def __init__(self, streams: list[tuple[int, AsyncIterator[StreamDelta]]], prompt_tokens: int) -> None:
        self._streams = streams
        self._tasks: list[asyncio.Task] = []
        self.usage = Usage(prompt_tokens=prompt_tokens)

    @classmethod
    def open(
        cls,
        engine: Any,
        prompts: list[list[int]],
        per_sample: list[SamplingParams],
        request_id: str,
        tags: Tags,
    ) -> ChoiceStreams:
        """Choice `j * n + i` streams prompt j with `per_sample[i]` (n of them), every one with
        `tags`. Raises ValueError on bad input."""
        n = len(per_sample)
        streams = [
            (
                j * n + i,
                engine.stream(p, params, request_id=f"{request_id}-{j}-{i}", **tags.engine_kwargs()),
            )
            for j, p in enumerate(prompts)
            for i, params in enumerate(per_sample)
        ]
        return cls(streams, sum(len(p) for p in prompts))

    async def __aiter__(self) -> AsyncIterator[tuple[int, list[StreamDelta]]]:
        """Yields `(index, deltas)`: one choice's deltas that came together. When the consumer
        lags behind the engine, everything that arrived meanwhile is taken at once, so a slow
        front end writes one chunk for several tokens instead of falling further behind (vLLM's
        front end merges a lagging stream's outputs the same way). A closing delta (an abort's,
        no token) always comes alone, so its chunk keeps no text."""
        queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._pump(i, s, queue)) for i, s in self._streams]
        running = len(self._tasks)
        try:
            while running:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                run: list[StreamDelta] = []
                run_index = -1
                for item in items:
                    if isinstance(item, tuple) and item[0] == run_index and item[1].token_id is not None:
                        run.append(item[1])
                        continue
                    if run:
                        yield run_index, run
                        run, run_index = [], -1
                    if item is None:
                        running -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        run_index, run = item[0], [item[1]]
                if run:
                    yield run_index, run
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, index: int, stream: AsyncIterator[StreamDelta], queue: asyncio.Queue) -> None:
        """Forwards one stream's deltas; None marks its end, an exception its failure."""
        try:
            async for delta in stream:
                if delta.token_id is not None:  # None: a closing delta, no token
                    self.usage.completion_tokens += 1
                if delta.num_cached_tokens is not None:
                    self.usage.cached_tokens += delta.num_cached_tokens
                queue.put_nowait((index, delta))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)
