"""Trace converters keep the traces' prefix sharing exactly; the real traces are not needed."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from radixkv.workloads.commands import add_convert_arguments, run_convert
from radixkv.workloads.convert import (
    ClaudeCodeParams,
    MooncakeParams,
    ShareGPTParams,
    convert_claude_code,
    convert_mooncake,
    convert_sharegpt,
)
from radixkv.workloads.format import Session, read_workload
from radixkv.workloads.traces import HashIdTokens, TraceFormatError


def _jsonl(path: Path, rows: list[object]) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


MOONCAKE = [
    {"timestamp": 1000, "input_length": 40, "output_length": 7, "hash_ids": [0, 1, 2, 3]},
    {"timestamp": 1500, "input_length": 30, "output_length": 0, "hash_ids": [0, 1, 9]},
    {"timestamp": 4000, "input_length": 20, "output_length": 900, "hash_ids": [5, 6]},
]


def test_mooncake_requests_sharing_k_ids_share_exactly_k_blocks(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "trace.jsonl", MOONCAKE)
    sessions = convert_mooncake(path, MooncakeParams(hash_block=8, vocab_size=1 << 20))
    a, b, c = (s.turns[0].user for s in sessions)
    assert (len(a), len(b), len(c)) == (32, 24, 16)
    assert _common_len(a, b) == 2 * 8 and _common_len(a, c) == 0
    assert a == HashIdTokens(8, vocab_size=1 << 20).tokens([0, 1, 2, 3])


def test_mooncake_arrivals_start_at_zero_and_replies_are_capped(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "trace.jsonl", MOONCAKE)
    sessions = convert_mooncake(path, MooncakeParams(hash_block=4, max_tokens_cap=100, time_scale=0.5))
    assert [s.name for s in sessions] == ["r0", "r1", "r2"]
    assert [s.arrival for s in sessions] == [0.0, 0.25, 1.5]
    assert [s.turns[0].max_tokens for s in sessions] == [7, 1, 100]
    assert all(s.system is None and set(s.turns[0].user) <= set(range(256)) for s in sessions)
    assert len(convert_mooncake(path, MooncakeParams(hash_block=4, max_requests=2))) == 2


def _agent(session: int, t: float, ids: list[int], agent: str = "main", out: int = 10) -> dict[str, object]:
    return {
        "session_id": session,
        "agent": agent,
        "t_session_s": t,
        "input_length": 64 * len(ids),
        "output_length": out,
        "hash_ids": ids,
    }


CLAUDE_CODE = [
    _agent(7, 0.0, [1, 2, 3]),
    _agent(7, 5.0, [1, 2, 3, 4, 5], out=0),
    _agent(8, 0.0, [20, 21]),
    _agent(7, 12.0, [1, 2, 3, 4, 5, 6]),
    _agent(8, 3.0, [30], agent="sub"),
    _agent(7, 100.0, [1, 2, 9]),
    _agent(8, 4.0, [20, 21, 22]),
    _agent(7, 130.0, [1, 2, 9, 10, 11]),
    _agent(7, 131.0, [1, 2, 9, 10, 11]),
]
# What each converted session's turns must rebuild, request by request.
EXPECTED = {
    "7": [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]],
    "7#1": [[1, 2, 9], [1, 2, 9, 10, 11]],
    "7#2": [[1, 2, 9, 10, 11]],
    "8": [[20, 21], [20, 21, 22]],
    "8#1": [[30]],
}


def _convert_cc(tmp_path: Path, **params: Any) -> list[Session]:
    path = _jsonl(tmp_path / "cc.jsonl.gz", CLAUDE_CODE)
    return convert_claude_code(path, ClaudeCodeParams(hash_block=4, rate=0.5, **params))


def test_claude_code_turns_concatenate_to_each_requests_tokens(tmp_path: Path) -> None:
    sessions = _convert_cc(tmp_path, common_prefix_tokens=10)
    tokens = HashIdTokens(4, vocab_size=256)
    common = sessions[0].system
    assert common is not None and len(common) == 10
    assert {s.name for s in sessions} == set(EXPECTED)
    for s in sessions:
        assert s.system == common
        users: list[int] = []
        for turn, ids in zip(s.turns, EXPECTED[s.name], strict=True):
            users += turn.user
            assert users == tokens.tokens(ids)


def test_claude_code_think_times_and_split_arrivals_follow_the_trace(tmp_path: Path) -> None:
    by_name = {s.name: s for s in _convert_cc(tmp_path, time_scale=0.5, max_think=3.0)}
    assert [t.think for t in by_name["7"].turns] == [0.0, 2.5, 3.0]
    assert [t.max_tokens for t in by_name["7"].turns] == [10, 1, 10]
    assert by_name["7#1"].arrival == pytest.approx(by_name["7"].arrival + 50.0)
    assert by_name["7#2"].arrival == pytest.approx(by_name["7"].arrival + 65.5)
    assert by_name["8#1"].arrival == pytest.approx(by_name["8"].arrival + 1.5)
    assert by_name["8"].turns[1].think == 2.0
    assert by_name["7"].arrival == 0.0 and by_name["8"].arrival > 0.0
    assert by_name["7"].system is None


def test_claude_code_session_arrivals_are_seeded(tmp_path: Path) -> None:
    arrivals = [s.arrival for s in _convert_cc(tmp_path)]
    assert arrivals == [s.arrival for s in _convert_cc(tmp_path)]
    assert arrivals != [s.arrival for s in _convert_cc(tmp_path, seed=1)]
    assert arrivals == sorted(arrivals)


def test_claude_code_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "cc.jsonl", [CLAUDE_CODE[0], {"session_id": 1, "hash_ids": [1]}])
    with pytest.raises(TraceFormatError, match=r"cc\.jsonl:2: .*missing 't_session_s'"):
        convert_claude_code(path, ClaudeCodeParams())


def _chat(*messages: tuple[str, str]) -> dict[str, object]:
    return {"conversations": [{"from": role, "value": value} for role, value in messages]}


SHAREGPT = [
    _chat(
        ("human", "Bonjour"),
        ("gpt", "Salut, ça va ?"),
        ("human", "Oui"),
        ("gpt", "x" * 900),
        ("human", "end"),
    ),
    _chat(("gpt", "I start"), ("human", "a"), ("human", "b"), ("gpt", "你好")),
    _chat(("human", "no reply")),
    _chat(("user", "q"), ("assistant", "r")),
]


def test_sharegpt_turns_ask_for_the_reply_length_in_bytes(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "sg.jsonl", SHAREGPT)
    sessions = convert_sharegpt(path, ShareGPTParams(system="Be brief.", max_tokens_cap=500, think=1.0))
    assert [s.name for s in sessions] == ["c0", "c1", "c3"]
    first, second, third = sessions
    assert [(t.user, t.max_tokens, t.think) for t in first.turns] == [("Bonjour", 15, 0.0), ("Oui", 500, 1.0)]
    assert [(t.user, t.max_tokens) for t in second.turns] == [("a\n\nb", 6)]
    assert [(t.user, t.max_tokens) for t in third.turns] == [("q", 1)]
    assert all(s.system == "Be brief." for s in sessions) and first.arrival == 0.0
    assert len(convert_sharegpt(path, ShareGPTParams(max_sessions=2, max_turns=1))[0].turns) == 1


def test_sharegpt_reads_a_json_array_too(tmp_path: Path) -> None:
    array = tmp_path / "sg.json"
    array.write_text(json.dumps(SHAREGPT), encoding="utf-8")
    lines = _jsonl(tmp_path / "sg.jsonl", SHAREGPT)
    assert convert_sharegpt(array, ShareGPTParams()) == convert_sharegpt(lines, ShareGPTParams())


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_chat(("robot", "hi")), "unknown role 'robot'"),
        ({"messages": []}, "missing 'conversations'"),
        ("{not json", "invalid JSON"),
    ],
)
def test_sharegpt_malformed_line_names_file_and_line(tmp_path: Path, row: object, message: str) -> None:
    path = _jsonl(tmp_path / "sg.jsonl", [SHAREGPT[0], row])
    with pytest.raises(TraceFormatError, match=rf"sg\.jsonl:2: .*{message}"):
        convert_sharegpt(path, ShareGPTParams())


def test_convert_command_writes_a_readable_workload_with_its_source(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="radixkv workload convert")
    add_convert_arguments(parser)
    trace, out = _jsonl(tmp_path / "trace.jsonl", MOONCAKE), tmp_path / "out.jsonl"
    assert run_convert(parser.parse_args(["mooncake", str(trace), "--hash-block", "16", "-o", str(out)])) == 0
    workload = read_workload(out)
    assert workload.meta["source"] == str(trace) and workload.meta["params"]["hash_block"] == 16
    assert workload.meta["command"].startswith(f"radixkv workload convert mooncake {trace} --hash-block 16")
    assert [len(s.turns[0].user) for s in workload.sessions] == [64, 48, 32]
