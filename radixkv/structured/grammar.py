"""Matchers for `StructuredOutputs` over one tokenizer, through llguidance.

Why llguidance (measured here, README "Structured output"): it builds no per-grammar token table
(a matcher is ready in about a millisecond, and a cached one is copied in about a microsecond),
its masks are right on a byte-level vocabulary (200 random-logit samples of a schema with a
`maxLength` string all parsed, where xgrammar 0.2.9 let 141 of 200 through with raw control
characters or broken UTF-8 inside strings), and it takes JSON schemas, regexes and Lark
grammars that embed schemas, which is what a tool call needs. outlines-core compiles a regex
index over the whole vocabulary up front: 19 s for `{"type": "object"}` on 259 tokens.

A compiled matcher is kept per spec (least recently used out past `capacity`); each sequence
gets its own copy (`LLMatcher.deep_copy`), so a spec seen before costs no compilation. JSON is
compact (no free whitespace): a model, random weights included, cannot pad a document forever.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.numpy
import numpy

from radixkv.structured.finite import has_finite_value
from radixkv.structured.spec import StructuredOutputs

COMPACT = {"whitespace_flexible": False}


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON text) that `spec` asks for."""
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else '{"type": "object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark(lark_choice(spec.choice))
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def lark_choice(choices: tuple[str, ...] | list[str]) -> str:
    """A Lark rule matching exactly one of `choices` (JSON string escapes are Lark's too)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Matchers over `tokenizer` (a Hugging Face fast tokenizer) for logits `vocab_size` wide,
    ending at `eos_token_ids`. Thread-safe: the server checks specs in worker threads while the
    engine makes matchers in its own."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], capacity: int = 256
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured output needs a model with a fast (Rust) Hugging Face tokenizer")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._compiled: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`. Raises `GrammarError` (a ValueError) when the grammar does
        not compile (an invalid schema, regex or grammar), matches nothing, or is a JSON schema
        with no finite value (`finite.has_finite_value`)."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled.deep_copy()
        compiled = self._compile(spec)  # outside the lock: another spec need not wait for this one
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    def check(self, spec: StructuredOutputs) -> None:
        """Compiles `spec` (and so caches it); ValueError if it does not compile."""
        self.matcher(spec)

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        spec.validate()
        if spec.json is not None:
            try:
                finite = has_finite_value(json.loads(spec.json))
            except RecursionError:
                raise GrammarError("the JSON schema nests too deeply") from None
            if not finite:
                raise GrammarError("the JSON schema admits no finite JSON value")
        try:
            grammar = grammar_text(spec)
        except Exception as e:  # the library's own parse errors (a schema that is not JSON, ...)
            raise GrammarError(str(e)) from e
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError("; ".join(messages))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error() or _first_mask_fails(matcher.deep_copy(), self.vocab_size):
            raise GrammarError("it matches no output at all")
        return matcher


class GrammarError(ValueError):
    """A spec that does not compile. `reason` says why in the schema's, regex's or grammar's own
    terms: the first line of the library's message, without the grammar text it would quote
    (for a tool call, the grammar the server wrote around the user's schema)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason.strip().splitlines()[0] if reason.strip() else "unknown error"
        super().__init__(f"structured_outputs does not compile: {self.reason}")


def _first_mask_fails(matcher: llguidance.LLMatcher, vocab_size: int) -> bool:
    """Whether `matcher` (a copy: this advances its state) errs computing its first mask: an
    empty language compiles, and shows only when no token can start it."""
    bitmask = numpy.zeros((1, (vocab_size + 31) // 32), dtype=numpy.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    return matcher.is_error()
