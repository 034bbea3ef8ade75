"""Incremental detokenization against the tokenizer's own full decode, and stop strings."""

from __future__ import annotations

import random

import pytest

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.model.tokenizer import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer()


def decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def run(text_ids: list[int], stop: tuple[str, ...] = (), prompt: list[int] = ()) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(decode, stop, start=len(prompt))
    tokens = list(prompt)
    for t in text_ids:
        tokens.append(t)
        detok.push(tokens)
        if detok.stopped:
            break
    detok.finish(tokens)
    return detok


def test_pieces_join_to_the_full_decode_and_never_split_a_character():
    rng = random.Random(0)
    alphabet = "aé€🙂 \n你"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        ids = TOKENIZER.encode(text) + ([258] if rng.random() < 0.5 else [])  # EOS, a special token
        detok = run(ids, prompt=TOKENIZER.encode("ö prompt"))
        assert detok.text == decode(ids) == text
        assert len(detok.pieces) == len(ids)
        assert all("\ufffd" not in p for p in detok.pieces)
        for p in detok.pieces:
            p.encode("utf-8")  # a lone surrogate or a split character would not encode


def test_a_truncated_character_shows_as_the_full_decode_does():
    ids = TOKENIZER.encode("ab🙂")[:-2]
    assert run(ids).text == decode(ids) == "ab\ufffd"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello world, goodbye", ("world",), "hello "),
        ("hello world", ("o w", "ld"), "hell"),  # the earliest stop string wins
        ("price: 5€ total", ("€ t",), "price: 5"),  # the stop string spans a multi-byte character
        ("no stop here", ("xyz",), "no stop here"),
        ("abcabd", ("abd",), "abc"),
    ],
)
def test_stop_strings_split_across_tokens_are_found_and_cut(text, stop, expected):
    detok = run(TOKENIZER.encode(text), stop)
    assert detok.text == expected
    assert detok.stopped == (expected != text)


@pytest.mark.parametrize("arrivals", [[19], [3, 5, 11], [1] * 19])
def test_tokens_pushed_as_they_arrive_stop_at_the_token_that_completes_the_stop_string(arrivals):
    """`push_to_stop` (the front end's, tokens coming a step's worth at a time) ends where pushing
    one token at a time does: at the token that completes the stop string, which spans a
    multi-byte character here."""
    prompt = TOKENIZER.encode("a prompt")
    text = TOKENIZER.encode("price: 5€ total, then more")
    one_by_one = run(text, ("€ t",), prompt)
    detok = IncrementalDetokenizer(decode, ("€ t",), start=len(prompt))
    tokens, stopped_at = list(prompt), None
    for count in arrivals:
        tokens.extend(text[len(tokens) - len(prompt) :][:count])
        stopped_at = detok.push_to_stop(tokens)
        if stopped_at is not None:
            break
    assert stopped_at - len(prompt) == len(one_by_one.pieces) == len(TOKENIZER.encode("price: 5€ t"))
    assert detok.text == one_by_one.text == "price: 5"
    assert detok.push_to_stop(tokens) is None  # stopped already: nothing more to find


def test_text_that_may_start_a_stop_string_is_held_back_until_settled():
    detok = IncrementalDetokenizer(decode, ("STOP",))
    tokens: list[int] = []
    released = []
    for t in TOKENIZER.encode("aSTObSTOP"):
        tokens.append(t)
        detok.push(tokens)
        released.append(detok.text)
    assert detok.stopped and detok.text == "aSTOb"
    # The last len("STOP") - 1 characters wait until the next tokens settle them.
    assert released[:5] == ["", "", "", "a", "aS"]


def test_each_token_decodes_a_bounded_window_not_the_whole_text():
    decoded = []

    def counting(ids: list[int]) -> str:
        decoded.append(len(ids))
        return decode(ids)

    ids = TOKENIZER.encode("héllo wörld 你好 🙂 " * 100)  # 2,700 tokens, multi-byte characters among them
    detok = IncrementalDetokenizer(counting)
    for n in range(1, len(ids) + 1):
        detok.push(ids[:n])
    assert detok.text == decode(ids)
    assert sum(decoded) <= 8 * len(ids), "decoding cost grows with the text: not incremental"
