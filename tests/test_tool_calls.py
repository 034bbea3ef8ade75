"""The Hermes tool-call parser on strings: whole replies, and the same replies streamed in every
split, which must send the same calls (name first, then argument fragments that add up)."""

from __future__ import annotations

import json

import pytest

from radixkv.server.tools import ToolStream, parse

TWO_CALLS = (
    'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": [1, {"a": "}"}]}}\n'
    '</tool_call>\n<tool_call>\n{"name":"time","arguments":{}}\n</tool_call>'
)
BROKEN = 'x <tool_call>\n{"name": "weather", "arguments": {"city": \n</tool_call> y'


def test_whole_reply_gives_content_and_calls_with_the_exact_argument_text():
    got = parse(TWO_CALLS)
    assert got.content == "Let me look."
    assert [(c.name, c.arguments) for c in got.calls] == [
        ("weather", '{"city": "Oslo", "days": [1, {"a": "}"}]}'),
        ("time", "{}"),
    ]
    assert json.loads(got.calls[0].arguments) == {"city": "Oslo", "days": [1, {"a": "}"}]}
    assert parse("no calls here").calls == [] and parse("no calls here").content == "no calls here"
    broken = parse(BROKEN)
    assert broken.calls == [] and broken.content == BROKEN  # a block that does not parse stays text


def stream(text: str, size: int, max_calls: int | None = None) -> tuple[str, list[dict], bool]:
    parser = ToolStream(max_calls)
    content, deltas = "", []
    for i in range(0, len(text), size):
        piece = parser.feed(text[i : i + size])
        content += piece.content
        deltas += piece.calls
    content += parser.finish().content
    return content, deltas, parser.called


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_reply_sends_the_same_calls_in_every_split(size):
    content, deltas, called = stream(TWO_CALLS, size)
    assert called and content.strip() == "Let me look."
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:  # a call opens: its index, id and name, with no arguments yet
            assert d["index"] not in calls and d["function"]["arguments"] == ""
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        else:
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    whole = parse(TWO_CALLS).calls
    assert [calls[i] for i in sorted(calls)] == [{"name": c.name, "arguments": c.arguments} for c in whole]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_parallel_tool_calls_false_keeps_the_first_call_whole_or_streamed(size):
    """`parallel_tool_calls: false` (max_calls 1): the second call and what follows are dropped."""
    first = parse(TWO_CALLS).calls[0]
    whole = parse(TWO_CALLS, max_calls=1)
    assert [(c.name, c.arguments) for c in whole.calls] == [(first.name, first.arguments)]
    assert whole.content == "Let me look."
    content, deltas, called = stream(TWO_CALLS, size, max_calls=1)
    assert called and content.strip() == "Let me look."
    assert {d["index"] for d in deltas} == {0}
    assert deltas[0]["function"]["name"] == first.name
    assert "".join(d["function"]["arguments"] for d in deltas) == first.arguments


@pytest.mark.parametrize("size", [1, 5])
def test_a_streamed_block_that_breaks_after_its_name_stays_a_call(size):
    """Its name was sent before the break showed: the call stands (a stream sends no retraction),
    and its block is not sent as content. Whole, the same reply is all content (above)."""
    content, deltas, called = stream(BROKEN, size)
    assert called and content == "x  y"
    assert deltas[0]["function"] == {"name": "weather", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas[1:]) == '{"city": \n'


def test_a_block_that_closes_unparsed_in_one_piece_is_content():
    content, deltas, called = stream(BROKEN, len(BROKEN))
    assert content == BROKEN and deltas == [] and not called


ONE_CALL = 'Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'


def cut_stream(text: str, size: int, named: str | None = None) -> tuple[str, dict[str, str] | None]:
    """`text` streamed in pieces of `size` and then cut: the content and the one call sent."""
    parser = ToolStream()
    content, deltas = "", []
    for i in range(0, len(text), size):
        piece = parser.feed(text[i : i + size])
        content, deltas = content + piece.content, deltas + piece.calls
    end = parser.finish(cut=True, named=named)
    content, deltas = content + end.content, deltas + end.calls
    if not deltas:
        return content, None
    assert {d["index"] for d in deltas} == {0}
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    return content, {"name": deltas[0]["function"]["name"], "arguments": arguments}


@pytest.mark.parametrize("named", [None, "weather"])
def test_a_reply_cut_anywhere_keeps_its_partial_call_and_no_markup(named):
    """Cut after every character (as `max_tokens` cuts it): the content never holds tool markup;
    once the block reaches its arguments the call is there, its arguments a prefix of the whole call's;
    streamed in any split, the same call. With a named tool_choice there is always a call."""
    (whole,) = parse(ONE_CALL).calls
    name_end = ONE_CALL.index('"arguments":') + len('"arguments":')  # where the name is known
    for k in range(len(ONE_CALL) + 1):
        text = ONE_CALL[:k]
        got = parse(text, cut=True, named=named)
        assert got.content == ("Sure."[:k] or None)  # the text before the block, never markup
        if k >= name_end or named is not None:
            (call,) = got.calls
            assert call.name == "weather" and whole.arguments.startswith(call.arguments)
        else:
            assert got.calls == []
        for size in (1, 4, len(text) or 1):
            content, call = cut_stream(text, size, named)
            assert content.strip() == (got.content or "")
            want = {"name": got.calls[0].name, "arguments": got.calls[0].arguments} if got.calls else None
            assert call == want
