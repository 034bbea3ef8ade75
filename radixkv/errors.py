"""The errors a request's caller gets when an engine step fails under it, or the engine is gone."""

from __future__ import annotations


class RequestError(RuntimeError):
    """The request failed inside an engine step (a forward pass, a block copy, the sampler or a
    beam update raised). The engine contained the failure: only that step's requests fail, their
    KV is released uncached, and the engine keeps serving. `__cause__` is the original exception."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"request {request_id} failed in an engine step: {type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.__cause__ = cause


class TensorParallelError(RuntimeError):
    """A tensor-parallel engine lost a rank: a worker died, stopped answering, or the ranks
    diverged. Its workers are stopped and every later step raises this error, so the requests of
    the step and of every later one fail with a `RequestError` caused by it."""


class InvariantError(AssertionError):
    """`check_invariants()` found the books wrong: the message names what broke (a block's
    refcount, a lock, a size, a stale index). Raised whatever the interpreter's flags: the checks
    are plain conditions, not `assert` statements, so `python -O` does not skip them. A subclass
    of AssertionError, as a failed check is a failed assertion about the engine's state."""


class EngineDeadError(RuntimeError):
    """The engine takes no more requests: its loop thread died (a bug outside any step's
    containment) or it was shut down. Requests in flight then got a `RequestError`."""
