"""What a caller reads back from the engine core: whether a request finished, its output or
beams, stream deltas, and text.

A finished request is handed back once (`take`, which forgets it) and raises the RequestError a
failed step gave it. Nothing here needs the step lock: no step touches a finished request, so
outputs and texts are made in the reader's thread (`radixkv.engine.output_processor`).
"""

from __future__ import annotations

from radixkv.engine.output_processor import beam_output, result_of, sample_output, stream_deltas
from radixkv.outputs import Beam, RequestOutput, StreamDelta
from radixkv.scheduler.request import Request, Sequence, Status


class RequestResults:
    """Mixed into `EngineCore`, which holds the requests (`_requests`), `abort` and the input
    processor that decodes (`inputs`)."""

    def is_finished(self, request_id: str) -> bool:
        return self._requests[request_id].status is Status.FINISHED

    def output(self, request_id: str) -> RequestOutput:
        """The output of a finished sampling request (and forgets the request). Raises the
        request's RequestError if a step failed it."""
        return sample_output(self.take(request_id))

    def beam_output(self, request_id: str) -> list[Beam]:
        """The beams of a finished beam-search request, best first (and forgets the request).
        An aborted search returns no beams."""
        return beam_output(self.take(request_id), self.decode)

    def result(self, request_id: str) -> RequestOutput | list[Beam]:
        """`output` or `beam_output`, as the request is."""
        return self.result_of(self.take(request_id))

    def take(self, request_id: str) -> Request:
        """Forgets a finished request and returns it, for `result_of`; raises its RequestError if
        a step failed it."""
        request = self._requests.pop(request_id)
        if request.error is not None:
            raise request.error
        return request

    def result_of(self, request: Request) -> RequestOutput | list[Beam]:
        """The output or beams of a finished request already taken (`take`). Needs no step lock:
        no step touches a finished request, so the texts can be made in the reader's thread."""
        return result_of(request, self.decode)

    def forget(self, request_id: str) -> None:
        """Drops a request's record, aborting it first if it is still going."""
        request = self._requests.get(request_id)
        if request is not None and request.status is not Status.FINISHED:
            self.abort(request_id)
        self._requests.pop(request_id, None)

    def stream_deltas(
        self, request: Request, seq: Sequence, start: int, end: int, finished: bool
    ) -> list[StreamDelta]:
        """See `radixkv.engine.output_processor.stream_deltas`."""
        return stream_deltas(request, seq, start, end, finished)

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens left out ("" for a model without a tokenizer)."""
        return self.inputs.decode(ids)
