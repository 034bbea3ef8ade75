"""The tokenizer endpoints, as vLLM spells them, for clients that count or build tokens themselves
(lm-eval, guidellm).

`POST /tokenize` takes `{"model", "prompt"}` (text, tokenized as the completions endpoint does,
without added special tokens) or `{"model", "messages"}` (through the chat template with the
generation prompt, as the chat endpoint builds its prompt) and answers `{"tokens", "count",
"max_model_len"}`. `POST /detokenize` takes `{"model", "tokens"}` and answers `{"prompt"}`.
`GET /tokenizer_info` describes the tokenizer: class, special tokens, chat template, vocabulary
size, `max_model_len`. Like the `/v1` routes they need the API key when one is set, and a model
without a tokenizer answers them with a 400. Tokenizing, the token-id check and decoding run in
worker threads, as the generation endpoints' tokenizing does (parsing the body stays on the event
loop, as there). A chat prompt is built as the chat endpoint builds it for the same key, known
replies spliced in from that key's cache namespace, so `count` is the prompt the engine would run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from radixkv.model.tokenizer_threads import PerThreadTokenizer
from radixkv.server.chat_prompt import chat_prompt_ids, template_tools
from radixkv.server.errors import APIError
from radixkv.server.protocol import ChatMessage, Tool
from radixkv.server.state import ServerState


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None  # rendered with `messages`, as the chat endpoint renders them


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(
    app: FastAPI, state: ServerState, parse: Callable[[Request, type[BaseModel]], Awaitable[Any]]
) -> None:
    """Adds the three routes to `app`; `parse` reads a body as a model (a 400 naming the field)."""
    engine = state.engine

    def tokenizer(request: Request) -> tuple[Any, str | None]:
        """The engine's tokenizer and the request's API key (its namespace under per-key isolation)."""
        key = state.authorize(request.headers.get("authorization"))
        if engine.tokenizer is None:
            raise APIError.bad_request("model", "this model has no tokenizer")
        return engine.tokenizer, key

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        tok, key = tokenizer(request)
        body = await parse(request, TokenizeRequest)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError.bad_request("prompt", "give either prompt or messages")
        if body.messages is not None:
            tools = template_tools(body.tools) if body.tools else None
            render = (chat_prompt_ids, tok, body.messages, state.replies, state.cache_salt(key, None), tools)
            ids = await asyncio.to_thread(*render)
        else:
            # The method is looked up in the worker: a per-thread tokenizer gives that thread's copy.
            ids = await asyncio.to_thread(lambda: tok.encode(body.prompt, add_special_tokens=False))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        tok, _ = tokenizer(request)
        body = await parse(request, DetokenizeRequest)
        state.check_model(body.model)
        vocab = engine.vocab_size

        def decode() -> str:
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError.bad_request("tokens", f"tokens must be token ids in [0, {vocab}), got {bad}")
            return tok.decode(body.tokens)

        return {"prompt": await asyncio.to_thread(decode)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict:
        tok, _ = tokenizer(request)
        return {
            "tokenizer_class": type(tok.own() if isinstance(tok, PerThreadTokenizer) else tok).__name__,
            "vocab_size": engine.vocab_size,
            "max_model_len": engine.max_model_len,
            "model_max_length": engine.max_model_len,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
        }
