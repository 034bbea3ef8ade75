"""Requests into the engine core, and the acts that end or change them between steps.

Submission never takes the step lock: a request is validated in the caller's thread
(`make_request`) and put on an inbox (`submit`) that the next step drains, so a caller never
waits for the forward in flight. Aborts, a sample's stop and a chat session's close are queued
the same way; with `wait` (the default) they are drained at once under the step lock, so they
are done when the call returns. `_drain` applies all of it, in that order, at the start of
every step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from radixkv.cache.salt import salt_offset, salted
from radixkv.engine.input_processor import Params, Prompt
from radixkv.scheduler.request import Request, Status


class RequestIntake:
    """Mixed into `EngineCore`, which holds the requests (`_requests`), the inbox and the queues
    of aborts, stops and closed sessions, both locks, the scheduler and the KV cache manager."""

    def make_request(
        self,
        prompt: Prompt,
        params: Params | None,
        request_id: str | None = None,
        *,
        call: str = "add_request",
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A validated request, not yet queued. `call` names the API: `generate` and `stream`
        take SamplingParams only, `beam_search` BeamSearchParams only (TypeError otherwise).
        Bad input raises ValueError naming the field, before any work. `session_id` makes it
        a turn of that chat session: what it caches ranks with the session under the `session`
        eviction policy until `close_session`. `cache_salt` gives it a cache namespace: it shares
        cached blocks only with requests of the same salt (`radixkv.cache.salt`); without one,
        with every other unsalted request."""
        request = self.inputs.make_request(
            prompt,
            params,
            request_id,
            call=call,
            session_id=session_id,
            cache_salt=cache_salt,
            in_use=self._requests,
        )
        spec = getattr(request.params, "structured_outputs", None)
        if spec is not None:  # the matcher lives where the sampler runs: in the core
            request.seqs[0].grammar = self.grammars.matcher(spec)
        return request

    def submit(self, requests: list[Request]) -> list[str]:
        """Queues requests for the next step; returns their ids. Never waits for a step."""
        with self._submit_lock:
            taken = next((r.request_id for r in requests if r.request_id in self._requests), None)
            if taken is not None:
                raise ValueError(f"request_id {taken!r} is already in use")
            for request in requests:
                if self.store is not None and len(request.prompt_ids) > 1:  # keyed as the cache keys it
                    keys = salted(request.prompt_ids[:-1], salt_offset(request.cache_salt))
                    request.store_lookup = self.store.lookup(keys)
                self._requests[request.request_id] = request
                self._inbox.append(request)
        if self.on_submit is not None:
            self.on_submit()
        return [r.request_id for r in requests]

    def add_request(
        self,
        prompt: Prompt,
        params: Params | None = None,
        *,
        request_id: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validates and queues a request; returns its id."""
        request = self.make_request(prompt, params, request_id, session_id=session_id, cache_salt=cache_salt)
        return self.submit([request])[0]

    def close_session(self, session_id: str, *, wait: bool = True) -> None:
        """The chat session has no more turns: under the `session` policy its cached blocks lose
        their rank over one-off requests' (a later turn with the same id revives it, and so does
        the admission of one of its turns still waiting). With `wait` (the default) that is done
        when this returns; without, before the next step schedules anything, as `abort` does."""
        self._queue(self._closed_sessions, session_id, wait)

    def abort(self, request_id: str, *, wait: bool = True) -> None:
        """Ends a request wherever it is (queued, prefilling, decoding, a beam group, the forks of
        n > 1): its computed KV is cached, its tables and locks released, its unfinished
        samples end with finish_reason "abort". With `wait` (the default) that is done when this
        returns; without, the next step does it. Unknown or finished requests are ignored."""
        self._queue(self._aborts, request_id, wait)

    def stop_sample(self, request_id: str, index: int, *, wait: bool = True) -> None:
        """A stop string found outside the core (the front end of a core in its own process,
        which detokenizes) ended sample `index` of a sampling request: the sample finishes with
        finish_reason "stop" at its next token, and the request at once, its computed KV cached,
        once every sample still running has been stopped so. `wait` as in `abort`. Unknown or
        finished requests and samples are ignored."""
        self._queue(self._stops, (request_id, index), wait)

    def _queue(self, queue: deque, item: Any, wait: bool) -> None:
        """Queues an abort, a stop or a session close for the next drain: at once, under the step
        lock, with `wait`; else the next step does it (`on_submit` wakes an idle loop)."""
        queue.append(item)
        if wait:
            with self._lock:
                self._notify(self._drain())
        elif self.on_submit is not None:
            self.on_submit()

    def _drain(self) -> list[Request]:
        """Applies queued submissions, then queued aborts and stops, then sessions closed;
        returns the requests they ended."""
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        ended = []
        while self._aborts:
            request = self._requests.get(self._aborts.popleft())
            if request is not None and request.status is not Status.FINISHED:
                ended.append(self._end_now(request, "abort"))
        while self._stops:
            request_id, index = self._stops.popleft()
            request = self._requests.get(request_id)
            if request is None or request.status is Status.FINISHED or request.is_beam_search:
                continue
            for seq in request.seqs:
                seq.stop_requested |= seq.index == index
            if request.seqs and all(seq.stop_requested for seq in request.seqs):
                ended.append(self._end_now(request, "stop"))
                self.stats.observe([request])  # finished, as a step's own are (an abort is not)
        while self._closed_sessions:
            self.kv.close_session(self._closed_sessions.popleft())
        return ended

    def _end_now(self, request: Request, reason: str) -> Request:
        """Ends a request wherever it is: its computed KV cached, its tables and locks released,
        its unfinished samples ending with `reason` (an ended beam search keeps no beams)."""
        for seq in request.seqs:  # all but the slots of a step in flight are computed
            if seq.table is not None:
                self.kv.cache_finished(seq.table, seq.tokens, seq.num_computed)
        self.scheduler.remove(request)
        if not request.is_beam_search:
            for seq in request.seqs:
                request.finish_seq(seq, reason)
        self._end(request)
        return request
