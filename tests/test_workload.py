"""The workload file reader and writer: every malformed line fails the whole file, naming file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixkv.workloads.format import Session, Turn, WorkloadError, read_workload, write_workload

GOOD_TEXT = {
    "session": "t0",
    "arrival": 0.5,
    "system": "You are terse.",
    "turns": [
        {"user": "Hello", "max_tokens": 32, "think": 0.0},
        {"user": "More", "max_tokens": 16, "think": 1.5},
    ],
}
GOOD_IDS = {
    "session": "i0",
    "arrival": 0,
    "system_ids": [1, 2, 3],
    "turns": [{"user_ids": [4, 5], "max_tokens": 2}],
}


def _write_lines(path: Path, rows: list[object]) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_text_and_id_sessions_with_metadata(tmp_path: Path) -> None:
    meta = {"format": "radixkv-workload", "version": 1, "generator": "hand", "seed": 3}
    workload = read_workload(_write_lines(tmp_path / "w.jsonl", [meta, GOOD_TEXT, "", GOOD_IDS]))
    assert workload.meta == {"generator": "hand", "seed": 3}
    text, ids = workload.sessions
    assert text == Session("t0", [Turn("Hello", 32), Turn("More", 16, 1.5)], 0.5, "You are terse.")
    assert ids == Session("i0", [Turn([4, 5], 2)], 0.0, [1, 2, 3])
    assert not text.uses_ids and ids.uses_ids


def test_metadata_line_is_optional_and_arrival_defaults_to_zero(tmp_path: Path) -> None:
    row = {"session": "a", "turns": [{"user": "hi", "max_tokens": 1}]}
    workload = read_workload(_write_lines(tmp_path / "w.jsonl", [row]))
    assert workload.meta == {}
    assert workload.sessions[0].arrival == 0.0 and workload.sessions[0].system is None


def _session(**changes: object) -> dict[str, object]:
    row = {"session": "bad", "arrival": 0.0, "system_ids": [1], "turns": [{"user_ids": [2], "max_tokens": 4}]}
    row.update(changes)
    return row


def _turn(**changes: object) -> dict[str, object]:
    turn: dict[str, object] = {"user_ids": [2], "max_tokens": 4}
    turn.update(changes)
    return _session(turns=[{"user_ids": [1], "max_tokens": 1}, turn])


MALFORMED = [
    ('{"session": "x", ', "not valid JSON"),
    ("[1, 2]", "a session must be a JSON object"),
    (_session(session=""), "session must be a non-empty string"),
    (_session(session=7), "session must be a non-empty string"),
    (_session(arrival=-0.5), "arrival must be a number of seconds >= 0"),
    (_session(arrival="soon"), "arrival must be a number of seconds >= 0"),
    (_session(turns=[]), "turns must be a non-empty list"),
    ({"session": "x", "system_ids": [1]}, "turns must be a non-empty list"),
    (_session(turns=[1]), "turns[0] must be a JSON object"),
    (_turn(max_tokens=0), "turns[1].max_tokens must be an integer >= 1"),
    (_turn(max_tokens=1.5), "turns[1].max_tokens must be an integer >= 1"),
    (_turn(max_tokens=True), "turns[1].max_tokens must be an integer >= 1"),
    ({"session": "x", "turns": [{"user": "hi"}]}, "turns[0].max_tokens must be an integer >= 1"),
    (_turn(think=-1), "turns[1].think must be a number of seconds >= 0"),
    (_turn(user_ids=[3, -1]), "turns[1].user_ids[1] must be a token id"),
    (_turn(user_ids=[3, 2.0]), "turns[1].user_ids[1] must be a token id"),
    (_turn(user_ids=[]), "turns[1].user_ids must be a non-empty list"),
    (_session(system_ids=[-4]), "system_ids[0] must be a token id"),
    (_turn(user="hi"), "turns[1] needs exactly one of user"),
    ({"session": "x", "turns": [{"max_tokens": 1}]}, "turns[0] needs exactly one of user"),
    (_session(system="text"), "give system or system_ids, not both"),
    ({"session": "x", "system": "text", "turns": [{"user_ids": [1], "max_tokens": 1}]}, "mixes text"),
    (
        _session(system_ids=None, turns=[{"user": "a", "max_tokens": 1}, {"user_ids": [1], "max_tokens": 1}]),
        "system_ids must be a non-empty list",
    ),
    (
        {"session": "x", "turns": [{"user": "a", "max_tokens": 1}, {"user_ids": [1], "max_tokens": 1}]},
        "mixes text",
    ),
    (_session(turn=[]), "turn is not a known key"),
    (_turn(max_token=4), "turns[1].max_token is not a known key"),
    ({"format": "radixkv-workload", "version": 1}, "the metadata line must be the first line"),
]


@pytest.mark.parametrize(("line", "message"), MALFORMED)
def test_malformed_line_fails_the_file_at_its_line(tmp_path: Path, line: object, message: str) -> None:
    path = _write_lines(tmp_path / "w.jsonl", [GOOD_IDS, "", line, GOOD_TEXT])
    with pytest.raises(WorkloadError) as error:
        read_workload(path)
    assert str(error.value).startswith(f"{path}:3: ")
    assert message in str(error.value)


def test_duplicate_session_name_names_both_lines(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "w.jsonl", [GOOD_IDS, GOOD_TEXT, GOOD_IDS])
    with pytest.raises(WorkloadError, match=r"w\.jsonl:3: session 'i0' is already on line 1"):
        read_workload(path)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"format": "other-format", "version": 1}, "format must be 'radixkv-workload'"),
        ({"format": "radixkv-workload", "version": 2}, "version 2 is not supported"),
        ({"format": "radixkv-workload"}, "version None is not supported"),
    ],
)
def test_bad_metadata_line_fails_the_file(tmp_path: Path, meta: dict[str, object], message: str) -> None:
    path = _write_lines(tmp_path / "w.jsonl", [meta, GOOD_IDS])
    with pytest.raises(WorkloadError, match=rf"w\.jsonl:1: {message}"):
        read_workload(path)


def test_file_without_sessions_fails(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "w.jsonl", [{"format": "radixkv-workload", "version": 1}])
    with pytest.raises(WorkloadError, match="no sessions"):
        read_workload(path)


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    sessions = [
        Session("a", [Turn([5, 6, 7], 3), Turn([8], 2, think=0.25)], arrival=1.5, system=[1, 2]),
        Session("b", [Turn([9], 1)]),
        Session("c", [Turn("Bonjour, ça va ?", 4), Turn("", 1, think=2.0)], arrival=3.0, system="Réponds."),
    ]
    path = tmp_path / "w.jsonl"
    write_workload(path, sessions, {"generator": "test", "params": {"n": 3}})
    workload = read_workload(path)
    assert workload.sessions == sessions
    assert workload.meta == {"generator": "test", "params": {"n": 3}}
    assert json.loads(path.read_text(encoding="utf-8").splitlines()[0])["format"] == "radixkv-workload"


@pytest.mark.parametrize(
    ("sessions", "message"),
    [
        ([Session("a", [Turn([1], 1)], system="text")], r"sessions\[0\]: mixes text"),
        ([Session("a", [Turn([1], 0)])], r"sessions\[0\]: turns\[0\].max_tokens must be an integer >= 1"),
        ([Session("a", [Turn([1], 1)]), Session("a", [Turn([2], 1)])], r"sessions\[1\]: session 'a' appears"),
        ([], "no sessions to write"),
    ],
)
def test_writer_refuses_what_reader_rejects(tmp_path: Path, sessions: list[Session], message: str) -> None:
    path = tmp_path / "w.jsonl"
    with pytest.raises(WorkloadError, match=message):
        write_workload(path, sessions, {})
    assert not path.exists()


def test_prompt_lengths_count_system_users_and_earlier_replies() -> None:
    session = Session("a", [Turn([1, 2, 3], 5), Turn([4], 2), Turn([5, 6], 1)], system=[0] * 10)
    assert session.prompt_lengths() == [13, 19, 23]
    with pytest.raises(ValueError, match="text"):
        Session("t", [Turn("hi", 1)]).prompt_lengths()
