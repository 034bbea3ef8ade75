"""Generators: deterministic by seed, the requested shape, prefixes really shared; the CLI records how."""

from __future__ import annotations

import argparse
import json
import shlex
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from radixkv.workloads.commands import add_gen_arguments, run_gen
from radixkv.workloads.format import Session, read_workload
from radixkv.workloads.generate import (
    ChatParams,
    DocsParams,
    OneUseParams,
    SharedPrefixParams,
    generate_chat,
    generate_docs,
    generate_one_use,
    generate_shared_prefix,
    poisson_arrivals,
)

REPO = Path(__file__).resolve().parents[1]

SMALL: list[tuple[Callable[[Any], list[Session]], Any]] = [
    (
        generate_chat,
        ChatParams(
            sessions=9,
            groups=3,
            turns=(2, 4),
            common_prefix_tokens=40,
            group_prefix_tokens=60,
            user_tokens=(5, 9),
            reply_tokens=(3, 6),
            think=0.5,
        ),
    ),
    (
        generate_shared_prefix,
        SharedPrefixParams(
            groups=3,
            prompts_per_group=4,
            system_tokens=(50, 70),
            question_tokens=(5, 8),
            output_tokens=(2, 4),
        ),
    ),
    (
        generate_docs,
        DocsParams(
            documents=2,
            document_tokens=(80, 120),
            few_shot=3,
            shots=3,
            shot_tokens=(5, 9),
            questions=40,
            question_tokens=(4, 6),
            answer_tokens=(2, 3),
            repeat=0.3,
        ),
    ),
    (
        generate_one_use,
        OneUseParams(
            sessions=30,
            prefixes=4,
            prefix_tokens=(20, 40),
            user_tokens=(8, 16),
            reply_tokens=(2, 4),
            returns=0.5,
        ),
    ),
]


def _prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _ids(sessions: list[Session]) -> list[int]:
    return [t for s in sessions for t in (s.system or []) + [t for turn in s.turns for t in turn.user]]


@pytest.mark.parametrize(("generate", "params"), SMALL)
def test_same_seed_gives_same_sessions_and_another_seed_differs(generate: Any, params: Any) -> None:
    assert generate(params) == generate(params)
    assert generate(replace(params, seed=1)) != generate(params)


@pytest.mark.parametrize(("generate", "params"), SMALL)
def test_ids_stay_in_the_vocabulary_range(generate: Any, params: Any) -> None:
    ids = _ids(generate(replace(params, vocab_low=100, vocab_size=110)))
    assert min(ids) >= 100 and max(ids) < 110 and len(set(ids)) == 10


def test_chat_groups_share_their_system_prompt_and_all_share_the_common_prefix() -> None:
    params = SMALL[0][1]
    sessions = generate_chat(params)
    assert len(sessions) == 9
    by_group: dict[str, list[Session]] = {}
    for s in sessions:
        by_group.setdefault(s.name.split(".")[0], []).append(s)
        assert s.system is not None and s.system[:40] == sessions[0].system[:40]
        assert 2 <= len(s.turns) <= 4
        assert all(5 <= len(t.user) <= 9 and 3 <= t.max_tokens <= 6 for t in s.turns)
        assert [t.think for t in s.turns] == [0.0] + [0.5] * (len(s.turns) - 1)
    assert sorted(by_group) == ["g0", "g1", "g2"]
    systems = [group[0].system for group in by_group.values()]
    assert all(s.system == group[0].system for group in by_group.values() for s in group)
    assert all(len(system) > 40 for system in systems)
    assert len({tuple(system) for system in systems}) == 3


def test_chat_group_prefix_lengths_are_lognormal_around_the_mean() -> None:
    params = ChatParams(
        sessions=400, groups=400, turns=(1, 1), common_prefix_tokens=0, group_prefix_tokens=1000
    )
    lengths = [len(s.system or []) for s in generate_chat(params)]
    assert 900 < np.mean(lengths) < 1100 and min(lengths) >= 1 and max(lengths) <= 5000
    assert np.median(lengths) < np.mean(lengths)


def test_shared_prefix_groups_interleave_over_identical_system_prompts() -> None:
    sessions = generate_shared_prefix(SMALL[1][1])
    assert len(sessions) == 12
    by_group: dict[str, list[Session]] = {}
    for s in sessions:
        by_group.setdefault(s.name.split(".")[0], []).append(s)
        assert len(s.turns) == 1 and 5 <= len(s.turns[0].user) <= 8 and 2 <= s.turns[0].max_tokens <= 4
        assert s.system is not None and 50 <= len(s.system) <= 70
    assert sorted(len(group) for group in by_group.values()) == [4, 4, 4]
    assert all(s.system == group[0].system for group in by_group.values() for s in group)
    assert [s.name.split(".")[0] for s in sessions] != sorted(s.name.split(".")[0] for s in sessions)


def test_docs_questions_use_few_contexts_and_repeats_are_verbatim() -> None:
    sessions = generate_docs(SMALL[2][1])
    contexts = {tuple(s.system or []) for s in sessions}
    assert len(contexts) <= 5
    originals = {s.name: s for s in sessions if ".r" not in s.name}
    repeats = [s for s in sessions if ".r" in s.name]
    assert repeats and len(originals) + len(repeats) == 40
    for repeat in repeats:
        first = originals[repeat.name.rsplit(".r", 1)[0]]
        assert (repeat.system, repeat.turns) == (first.system, first.turns)
        assert repeat.arrival >= first.arrival
    preambles = [s.system or [] for s in sessions if s.name.startswith("fewshot")]
    assert preambles and all(3 * 5 <= len(p) <= 3 * 9 for p in preambles)


def _block_uses(sessions: list[Session], block: int) -> tuple[Counter[tuple[int, ...]], list[int]]:
    """The oracle for `one-use`: replays the turns in arrival order (think times only, as
    `simulate` orders them) with stand-in replies, counts how many prompts hold each full block
    (keyed by the whole prefix up to its end, as the cache keys it), and gives each return's
    distance in requests from its session's previous turn."""
    turns = []  # (arrival, session index, turn index)
    for i, session in enumerate(sessions):
        at = session.arrival
        for k, turn in enumerate(session.turns):
            at += turn.think
            turns.append((at, i, k))
    turns.sort()
    uses: Counter[tuple[int, ...]] = Counter()
    last_seen: dict[int, int] = {}
    gaps = []
    for order, (_, i, k) in enumerate(turns):
        session = sessions[i]
        prompt = list(session.system or [])
        for j, turn in enumerate(session.turns[: k + 1]):
            prompt += list(turn.user) + ([-1 - j] * turn.max_tokens if j < k else [])
        uses.update(tuple(prompt[:end]) for end in range(block, len(prompt) + 1, block))
        if k:
            gaps.append(order - last_seen[i])
        last_seen[i] = order
    return uses, gaps


def test_one_use_blocks_are_mostly_used_once_and_returns_come_after_the_median_gap() -> None:
    params = OneUseParams(
        sessions=600,
        prefixes=20,
        prefix_tokens=(64, 256),
        user_tokens=(128, 256),
        returns=0.3,
        gap_requests=100,
    )
    uses, gaps = _block_uses(generate_one_use(params), 16)
    once = sum(1 for n in uses.values() if n == 1) / len(uses)
    assert 0.6 < once < 0.95
    assert 70 <= float(np.median(gaps)) <= 140  # Pareto median at the asked 100 requests
    assert max(gaps) > 3 * float(np.median(gaps))  # the heavy tail
    fewer = replace(params, user_tokens=(16, 32), returns=0.6)
    assert sum(1 for n in _block_uses(generate_one_use(fewer), 16)[0].values() if n == 1) / len(uses) < once


def test_one_use_prefix_popularity_follows_zipf() -> None:
    sessions = generate_one_use(
        OneUseParams(
            sessions=4000, prefixes=10, popularity=1.0, prefix_tokens=(4, 4), user_tokens=(1, 1), returns=0.0
        )
    )
    counts = Counter(s.name.split(".")[0] for s in sessions)
    # Zipf with exponent 1 over 10 prefixes: the first is drawn 1 / H(10) = 34% of the time,
    # the second half as often.
    assert 0.30 < counts["p0"] / 4000 < 0.38 and 1.6 < counts["p0"] / counts["p1"] < 2.5
    uniform = generate_one_use(
        OneUseParams(
            sessions=4000, prefixes=10, popularity=0.0, prefix_tokens=(4, 4), user_tokens=(1, 1), returns=0.0
        )
    )
    assert max(Counter(s.name.split(".")[0] for s in uniform).values()) < 0.13 * 4000


def test_poisson_arrivals_have_the_requested_rate() -> None:
    arrivals = poisson_arrivals(np.random.default_rng(0), 4000, rate=4.0)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert 0.23 < np.mean(np.diff(arrivals)) < 0.27
    assert poisson_arrivals(np.random.default_rng(0), 3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="--rate must be > 0"):
        poisson_arrivals(np.random.default_rng(0), 3, 0.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ChatParams(sessions=2, groups=3), r"--groups \(3\) must be at most --sessions \(2\)"),
        (lambda: ChatParams(turns=(4, 2)), "--turns 4-2: the low end is above the high end"),
        (lambda: ChatParams(user_tokens=(0, 3)), "--user-tokens must be >= 1, got 0"),
        (lambda: ChatParams(vocab_low=256), "need 0 <= --vocab-low < --vocab-size"),
        (lambda: DocsParams(repeat=1.5), r"--repeat must be in \[0, 1\], got 1.5"),
        (lambda: DocsParams(documents=0, few_shot=0), "need at least one context"),
    ],
)
def test_bad_parameters_name_the_flag(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def _gen_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixkv workload gen")
    add_gen_arguments(parser)
    return parser


def test_gen_command_records_a_command_that_remakes_the_file(tmp_path: Path) -> None:
    out = tmp_path / "chat.jsonl"
    flags = "--sessions 4 --groups 2 --turns 2 --user-tokens 3-5 --common-prefix-tokens 8 --rate inf"
    args = _gen_parser().parse_args(["chat", *flags.split(), "-o", str(out)])
    assert run_gen(args) == 0
    meta = read_workload(out).meta
    assert meta["generator"] == "gen chat" and meta["seed"] == 0 and meta["vocab"] == {"low": 0, "size": 256}
    assert meta["params"]["turns"] == [2, 2] and meta["params"]["rate"] == float("inf")
    again = tmp_path / "again.jsonl"
    words = shlex.split(meta["command"])
    assert words[:3] == ["radixkv", "workload", "gen"] and words[-2:] == ["-o", str(out)]
    assert run_gen(_gen_parser().parse_args([*words[3:-1], str(again)])) == 0
    assert again.read_text().replace(str(again), str(out)) == out.read_text()


def test_gen_command_reports_bad_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.jsonl"
    args = _gen_parser().parse_args(["chat", "--sessions", "2", "--groups", "3", "-o", str(out)])
    assert run_gen(args) == 1
    assert "--groups (3) must be at most --sessions (2)" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("path", sorted((REPO / "workloads").glob("*.jsonl")), ids=lambda p: p.name)
def test_shipped_workload_is_remade_by_its_recorded_command(tmp_path: Path, path: Path) -> None:
    shipped = read_workload(path)
    words = shlex.split(shipped.meta["command"])
    assert words[:3] == ["radixkv", "workload", "gen"] and words[-2] == "-o"
    out = tmp_path / path.name
    assert run_gen(_gen_parser().parse_args([*words[3:-1], str(out)])) == 0
    recorded = json.loads(path.read_text().splitlines()[0])["command"]
    assert out.read_text().replace(shlex.join([*words[:-1], str(out)]), recorded) == path.read_text()
