"""Input processing: a prompt and its params checked and made into a `Request`, before any work.

Shared by the engine core (in process) and the front end of an engine in its own process
(`radixkv.engine.process`), which validates and tokenizes in the caller's process so that bad
input is a ValueError at the call and the core only ever receives requests that fit. It needs no
model, only the numbers that bound a request: the tokenizer, vocabulary size, `max_model_len`,
`max_num_seqs`, the KV pool's size in blocks and, with sliding-window KV groups
(`radixkv.cache.kv_groups`), the windows of groups 1.. and the step's token budget.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Container
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.excerpt import excerpt
from radixkv.model.tokenizer_threads import PerThreadTokenizer
from radixkv.sampling.sampler import make_generator
from radixkv.sampling_params import BeamSearchParams, SamplingParams
from radixkv.scheduler.request import Request, Sequence

Prompt = str | list[int]
Params = SamplingParams | BeamSearchParams


class InputProcessor:
    """`device` is where a seeded sample's generator lives (None: make none, as a front end
    does; the core makes its own when it builds the request again). `windows`: the windows of
    KV groups 1.. (`KVCacheManager.windows`; None for a second global group), whose blocks come
    from the same pool; `max_num_batched_tokens` bounds the prefill chunk a sliding group holds
    at once."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        max_num_seqs: int,
        num_blocks: int,
        block_size: int,
        device: Any = None,
        windows: tuple[int | None, ...] = (),
        max_num_batched_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self._backend_decodes = _decodes_as_its_backend(tokenizer)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.windows = windows
        self.max_num_batched_tokens = max_num_batched_tokens
        self._ids = itertools.count()

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens left out ("" for a model without a tokenizer).

        A Hugging Face fast tokenizer whose decoding is the base class's and cleans up no spaces
        is decoded by its Rust backend directly (`_decodes_as_its_backend`): the same text as its
        `decode`, which adds only conversions of its input, in well under half the time (1.05 us
        against 2.58 us for 3 tokens, through `PerThreadTokenizer`); a streamed token costs two
        decodes (`radixkv.engine.detokenizer`), and the front end makes every stream's text."""
        if self.tokenizer is None:
            return ""
        if self._backend_decodes:
            return self.tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def make_request(
        self,
        prompt: Prompt,
        params: Params | None,
        request_id: str | None = None,
        *,
        call: str = "add_request",
        session_id: str | None = None,
        cache_salt: str | None = None,
        in_use: Container[str] = (),
    ) -> Request:
        """A validated request, not yet queued (see `EngineCore.make_request`); `in_use` holds the
        ids of requests still going, which a new one may not take."""
        expected: tuple[type, ...] = {
            "generate": (SamplingParams,),
            "stream": (SamplingParams,),
            "beam_search": (BeamSearchParams,),
        }.get(call, (SamplingParams, BeamSearchParams))
        if params is None:
            params = expected[0]()
        if isinstance(params, SamplingParams | BeamSearchParams) and not isinstance(params, expected):
            raise TypeError(f"{call} takes {expected[0].__name__}, got {type(params).__name__}")
        if not isinstance(params, expected):
            raise ValueError(
                f"params must be {' or '.join(t.__name__ for t in expected)}, got {excerpt(params)}"
            )
        params.validate()
        params = copy.deepcopy(params)  # later changes by the caller do not reach the running request
        ids = self.prompt_ids(prompt)
        self._check_params(params)
        self._check_fits(ids, params)
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in in_use:
                request_id = str(next(self._ids))
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {excerpt(request_id)}")
        elif request_id in in_use:
            raise ValueError(f"request_id {excerpt(request_id)} is already in use")
        seq = Sequence(list(ids), len(ids))
        if isinstance(params, SamplingParams):
            if params.seed is not None and self.device is not None:
                seq.generator = make_generator(params.seed, self.device)
            if self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer(self.decode, params.stop, start=len(ids))
            if params.logprobs is not None:
                seq.token_logprobs = []
        if session_id is not None and (not isinstance(session_id, str) or not session_id):
            raise ValueError(f"session_id must be a non-empty string, got {excerpt(session_id)}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {excerpt(cache_salt)}")
        request = Request(request_id, list(ids), params, [seq], session_id=session_id, cache_salt=cache_salt)
        if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        return request

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, checked: not empty, shorter than `max_model_len`, in the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text, but this model has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list):
            ids = prompt
        else:
            raise ValueError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:  # before the scan below: a huge prompt is refused at once
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len {self.max_model_len} leaves no room to generate"
            )
        vocab = self.vocab_size
        bad = next(
            (t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None
        )
        if bad is not None:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {excerpt(bad)}")
        return ids

    def _check_params(self, params: Params) -> None:
        """What the params alone cannot check: token ids against the vocabulary, stop strings
        against the tokenizer."""
        if isinstance(params, BeamSearchParams):
            return
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} must hold token ids in [0, {self.vocab_size}), got {bad}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none: use stop_token_ids")

    def _check_fits(self, ids: list[int], params: Params) -> None:
        """A request that could not fit in the pool even alone would wait forever: refuse it."""
        width = params.beam_width if isinstance(params, BeamSearchParams) else params.n
        if width > self.max_num_seqs:
            field = "beam_width" if isinstance(params, BeamSearchParams) else "n"
            raise ValueError(f"{field} {width} exceeds max_num_seqs {self.max_num_seqs}")
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        prompt_blocks = self._blocks_for(len(ids))
        need = one = prompt_blocks + width * (self._blocks_for(total) - prompt_blocks + 1)
        for window in self.windows:  # a sliding group: a prefill chunk's span, or each
            if window is None:  # sequence's window while they decode
                need += one
            else:
                chunk = self._blocks_for(window + self.max_num_batched_tokens) + 1
                need += min(one, max(chunk, width * (self._blocks_for(window) + 2)))
        if need > self.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks (prompt {len(ids)} tokens, max_tokens "
                f"{params.max_tokens}, {width} sequences) but the pool has {self.num_blocks}; "
                "raise kv_cache_memory or shorten the request"
            )

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _decodes_as_its_backend(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=True)` is its Rust backend's decode of
    the same ids: a fast tokenizer that overrides neither `decode` nor `_decode` (some rewrite
    the text, as CPM's or Whisper's do) and does not clean up spaces before punctuation."""
    base = tokenizer.own() if isinstance(tokenizer, PerThreadTokenizer) else tokenizer
    kind = type(base)
    return (
        isinstance(base, PreTrainedTokenizerFast)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is PreTrainedTokenizerFast._decode
        and not base.clean_up_tokenization_spaces
    )
