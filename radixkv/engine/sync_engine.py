"""The engine for library users and scripts: blocking calls over the shared `EngineCore`.

Any thread may submit at any time; the engine steps in whichever threads are waiting for results
(`generate`, `stream`, `beam_search`, `run_until`), one step at a time under the core's step
lock, and requests from all threads share every step's batch. A call interrupted by an exception
(KeyboardInterrupt included), and a `stream()` whose consumer stops, abort the requests they
submitted. For a background loop and an asyncio API, see `AsyncEngine`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from radixkv.chat_session import ChatSession
from radixkv.engine.core import EngineCore
from radixkv.engine.input_processor import Prompt
from radixkv.outputs import Beam, RequestOutput, StreamDelta
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.scheduler.request import Status


class Engine(EngineCore):
    def run_until(self, done: Callable[[], bool]) -> None:
        """Steps the engine until `done()`. Never spins: when steps stop running batches before
        `done()` (a request lost, or one that can never be scheduled), raises RuntimeError."""
        idle = 0
        while not done():
            before = self.num_steps
            self.step()
            idle = idle + 1 if self.num_steps == before else 0
            if idle > 2 and not done():  # a step after a preemption may rightly run nothing
                raise RuntimeError("the engine stopped making progress before the awaited requests finished")

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts (text or token-id lists) to completion, batched together. Raises the
        RequestError of a request that a failed step ended. `session_id`, `cache_salt`: see
        `add_request`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        # All valid, or none queued.
        requests = [
            self.make_request(p, params, call="generate", session_id=session_id, cache_salt=cache_salt)
            for p in prompts
        ]
        ids = self.submit(requests)
        try:
            self.run_until(lambda: all(r.status is Status.FINISHED for r in requests))
            return [self.output(i) for i in ids]
        finally:
            for i in ids:
                self.forget(i)

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Iterator[StreamDelta]:
        """Yields each generated token as soon as it is made, with its piece of text; the last
        delta carries the finish reason, on a closing delta without a token when the request was
        aborted (`StreamDelta`). Closing the iterator early (or dropping it) aborts the request."""
        request = self.make_request(
            prompt, params, call="stream", session_id=session_id, cache_salt=cache_salt
        )
        if request.params.n != 1:
            raise ValueError(f"stream takes n == 1, got n={request.params.n}")
        return self._stream(request)

    def _stream(self, request) -> Iterator[StreamDelta]:
        self.submit([request])
        seq = request.seqs[0]  # with n == 1 this sequence lives from submission to the end
        base, sent = seq.num_prompt_tokens, 0
        try:
            while True:
                self.run_until(lambda n=sent: request.status is Status.FINISHED or len(seq.tokens) > base + n)
                with self._lock:  # what the steps published; the text is made outside the lock
                    if request.error is not None:
                        raise request.error
                    finished = request.status is Status.FINISHED
                    end = len(seq.tokens) - base
                deltas = self.stream_deltas(request, seq, sent, end, finished)
                sent = end
                yield from deltas
                if finished:
                    return
        finally:
            self.forget(request.request_id)

    def beam_search(
        self, prompt: Prompt, params: BeamSearchParams | None = None, cache_salt: str | None = None
    ) -> list[Beam]:
        """Beam search inside the engine: beams share their blocks and copy only a partly filled
        last block when they write. Returns the `beam_width` best hypotheses, best first."""
        request = self.make_request(prompt, params, call="beam_search", cache_salt=cache_salt)
        (request_id,) = self.submit([request])
        try:
            self.run_until(lambda: request.status is Status.FINISHED)
            return self.beam_output(request_id)
        finally:
            self.forget(request_id)

    def chat(self, system: str | list[int] | None = None) -> ChatSession:
        """A chat session whose every turn reuses the KV of the conversation before it."""
        return ChatSession(self, system)
