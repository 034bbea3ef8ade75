"""The messages between the front end and the engine core process (msgspec, MessagePack).

Compact by design: positional (`array_like`) structs, token ids as raw int32 bytes rather than
lists of objects, and one `StepOutput` per engine step carrying every request's news (and one
for a request that a `StopSample` ended between steps). Params
travel pickled (small, and rich in types a schema would have to repeat).

Front end to core, on one PUSH/PULL pair: `AddRequest`, `Abort`, `StopSample`, `CloseSession`,
`Shutdown`.
Core to front end, on another: `Ready` once the core is built (or `Fatal` if it could not be,
or its loop broke), then one `StepOutput` per step. Control calls (`ControlCall`, answered by
`ControlReply`) use a REQ/REP pair of their own, answered between two steps.
"""

from __future__ import annotations

from array import array

import msgspec

from radixkv.outputs import TokenLogprob


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """A request the front end validated. `call` is the API that made it (`generate`, `stream`,
    `beam_search`); `stream` asks for its tokens step by step rather than at its end (the front
    end asks it for every request with stop strings, which it finds itself: its params come
    without them); `arrival_time` is the front end's `time.perf_counter()` (system-wide on Linux)."""

    request_id: str
    prompt: bytes  # int32 token ids
    params: bytes  # pickled SamplingParams or BeamSearchParams
    call: str
    stream: bool
    arrival_time: float
    session_id: str | None = None
    cache_salt: str | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class StopSample(msgspec.Struct, tag=True, array_like=True):
    """The front end found a stop string in sample `index` of a request (`EngineCore.stop_sample`)."""

    request_id: str
    index: int


class CloseSession(msgspec.Struct, tag=True, array_like=True):
    session_id: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort what runs, close the core (its store written, its workers stopped) and exit."""


ToCore = AddRequest | Abort | StopSample | CloseSession | Shutdown


class SeqUpdate(msgspec.Struct, array_like=True):
    """A sequence's tokens since the last update (int32 bytes), their logprob records when asked
    for, and its finish reason and beam score once it has finished."""

    index: int
    tokens: bytes
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    score: float | None = None


class Done(msgspec.Struct, array_like=True):
    """A request's end. `error` (with `error_type`, the exception's class name) when a step
    failed it; times are the core's `time.perf_counter()`."""

    finish_time: float
    first_token_time: float | None = None
    error: str | None = None
    error_type: str | None = None


class RequestUpdate(msgspec.Struct, array_like=True):
    """One request's news in a step. A streamed request gets its sequences' new tokens each
    step, any other only at its end; with `done`, `seqs` lists every finished sequence, in the
    order the engine finished them (a beam search's best first)."""

    request_id: str
    seqs: list[SeqUpdate]
    num_cached_tokens: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    done: Done | None = None


class StepOutput(msgspec.Struct, tag=True, array_like=True):
    """What one step changed (or a stop between steps); `running_seqs` is the scheduler's count
    after it."""

    updates: list[RequestUpdate]
    running_seqs: int
    num_steps: int


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The core is built: the numbers the front end validates requests against."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    pid: int
    windows: list[int | None]  # of KV groups 1.. (`KVCacheManager.windows`)


class Fatal(msgspec.Struct, tag=True, array_like=True):
    """The core could not be built, or its loop broke outside a step's containment; it exits.
    `invalid` is a ValueError's own message when the config itself was refused (the front end
    raises it as a ValueError, as an engine built in process would)."""

    message: str
    invalid: str = ""


FromCore = StepOutput | Ready | Fatal


class ControlCall(msgspec.Struct, array_like=True):
    method: str  # one of `core_process.CONTROL_METHODS`
    args: tuple = ()


class ControlReply(msgspec.Struct, array_like=True):
    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # MessagePack of the result (nil: None)
    error: str | None = None
    error_type: str | None = None


def pack_ids(ids: list[int]) -> bytes:
    return array("i", ids).tobytes()


def unpack_ids(data: bytes) -> array:
    ids = array("i")
    ids.frombytes(data)
    return ids
