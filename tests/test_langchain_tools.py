"""LangChain's `ChatOpenAI.bind_tools(..., tool_choice="required")` against the server, over an
in-process ASGI transport: the client as users run it (langchain-openai, the `test` extra).

A tool whose schema has a string with no `maxLength` can run to `max_tokens` inside the call. The
server answers it as vLLM does: finish "length", the partial call in `tool_calls`, no markup in
`content`; so LangChain reports an invalid tool call (its arguments are not yet JSON) by the
tool's name, never text. Given room, the same request is a whole call LangChain parses to a dict.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pydantic import BaseModel

from radixkv import AsyncEngine, EngineConfig
from radixkv.server.app import build_app

langchain_openai = pytest.importorskip("langchain_openai")


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str  # no maxLength: nothing bounds the call but max_tokens


def ask(folder, max_tokens: int):
    async def main():
        engine = AsyncEngine(EngineConfig(model=str(folder), block_size=4, kv_cache_memory="8MiB"))
        app = build_app(engine, "tiny", session_idle_timeout_s=0)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://radixkv") as http:
            chat = langchain_openai.ChatOpenAI(
                model="tiny",
                base_url="http://radixkv/v1",
                api_key="x",
                http_async_client=http,
                max_tokens=max_tokens,
                temperature=0.8,
                seed=5,
                max_retries=0,
            )
            try:
                return await chat.bind_tools([GetWeather], tool_choice="required").ainvoke("Weather in Oslo?")
            finally:
                await engine.shutdown()

    return asyncio.run(main())


def test_a_forced_call_cut_by_max_tokens_is_an_invalid_tool_call_by_name_not_text(model_folders):
    # <tool_call>, a newline and {"name":"GetWeather","arguments":{"city":" are 55 byte tokens;
    # closing the string, the object and the block takes 15 more: 64 always cuts inside the call.
    reply = ask(model_folders["llama"], max_tokens=64)
    assert reply.response_metadata["finish_reason"] == "length"
    assert "<tool_call>" not in reply.content and "GetWeather" not in reply.content
    assert reply.tool_calls == []
    (partial,) = reply.invalid_tool_calls
    assert partial["name"] == "GetWeather" and partial["args"].startswith('{"city":"')


@pytest.mark.slow  # some 500 tokens of random weights' city name
def test_a_forced_call_with_room_is_a_parsed_tool_call(model_folders):
    reply = ask(model_folders["llama"], max_tokens=2000)  # seeded: this sample closes its string
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    (call,) = reply.tool_calls
    assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str)
    assert reply.content == "" and reply.invalid_tool_calls == []
