"""radixkv: an LLM inference engine that never computes the same prefix twice.

Paged KV blocks (as in vLLM's PagedAttention) under a radix tree of token prefixes (as in
SGLang's RadixAttention), with token-granular prefix hits, copy-on-write block sharing, beam
search inside the engine and a replay tool that measures time to first token.

The public names load on first use, so the cache core and the command line start without
importing torch, transformers and triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEngine": "radixkv.engine.async_engine",
    "Beam": "radixkv.outputs",
    "BeamSearchParams": "radixkv.sampling_params",
    "Engine": "radixkv.engine.sync_engine",
    "EngineConfig": "radixkv.config",
    "EngineDeadError": "radixkv.errors",
    "InvariantError": "radixkv.errors",
    "RequestError": "radixkv.errors",
    "RequestOutput": "radixkv.outputs",
    "Sample": "radixkv.outputs",
    "SamplingParams": "radixkv.sampling_params",
    "StreamDelta": "radixkv.outputs",
    "TokenLogprob": "radixkv.outputs",
}
__all__ = [
    "AsyncEngine",
    "Beam",
    "BeamSearchParams",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "InvariantError",
    "RequestError",
    "RequestOutput",
    "Sample",
    "SamplingParams",
    "StreamDelta",
    "TokenLogprob",
]

if TYPE_CHECKING:
    from radixkv.config import EngineConfig
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.sync_engine import Engine
    from radixkv.errors import EngineDeadError, InvariantError, RequestError
    from radixkv.outputs import Beam, RequestOutput, Sample, StreamDelta, TokenLogprob
    from radixkv.sampling_params import BeamSearchParams, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
