"""Every `python` and `bash` block of the documentation (docs/ and README.md) runs, unless its page
says why not.

The convention: a fenced block tagged `python` or `bash` is an example. An HTML comment
`<!-- not run: REASON -->` on the line before it keeps it from running (a GPU, the network, a
long benchmark), and `<!-- run: slow -->` runs it in the slow tier only. A bash block that is one
`radixkv serve` command is marked `<!-- run: server -->`, and the blocks after it that talk to
that server (at `localhost:8000`) `<!-- run: with server -->`: the slow tier starts the server
on a free port (the blocks' `8000` rewritten to it), runs those blocks against it (the bash
ones in order, then the Python ones in one interpreter), and stops it with SIGTERM, which must
end it with 0. Every fence must
name its language (`text` for a synopsis or an outline), so no command hides in an untagged block,
and the blocks not run are counted per page against `NOT_RUN`, so a new one is a decision made here.

A page's Python blocks run in order in one namespace, in one fresh interpreter, as a reader would
type them into one session (top-level `await` allowed). Each bash block runs under
`bash -euo pipefail` in a temporary folder that holds a copy of the repository's `workloads/`
(an example that writes a workload rewrites the copy) and a link to each public trace the block
names (`PUBLIC_TRACES`, from `shared/traces/`; a block whose trace this checkout lacks is
skipped). Examples use the presets (seeded random weights, nothing downloaded) and small
arguments; the ones that take minutes (full replays, benchmarks) are marked `run: slow`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
from shared_traces import shared_trace
from test_server import free_port

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^(\s*)```(.*)$")
MARK = re.compile(r"^\s*<!--\s*(not run|run):\s*(.*?)\s*-->\s*$")
RUN_REASONS = ("slow", "server", "with server")
DOC_PORT = "8000"
EXAMPLE_LANGUAGES = {"python", "bash"}
# A block's time limit; a `run: slow` one (a replay of minutes: 200 s on a quiet 2-core machine)
# runs beside the fast tier in CI, so it gets room for the load.
TIMEOUT_S, SLOW_TIMEOUT_S = 600, 1800
# The public traces the pages run examples on (the pages name where to download them).
PUBLIC_TRACES = ("mooncake_synthetic_trace.jsonl", "claude_code_sessions36.jsonl.gz")

# Blocks each page does not run, each with its reason written before it in the page.
NOT_RUN = {
    "README.md": 3,
    "docs/benchmarks.md": 2,
    "docs/getting-started.md": 3,
    "docs/restart.md": 2,
    "docs/serving.md": 3,
}

# The block that `.ci/run` checks for, verbatim: it installs, so it is never run here.
TEST_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
    ' && pip install -e ".[test]" && pytest'
)


class Block(NamedTuple):
    page: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    mark: str | None  # "not run", "run" or None
    reason: str


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a page, with the mark on the line before it."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text().split("\n")
    found = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, info = opening.group(1), opening.group(2).strip()
        end = i + 1
        while not (FENCE.match(lines[end]) and FENCE.match(lines[end]).group(2).strip() == ""):
            end += 1
        body = [line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]]
        mark = MARK.match(lines[i - 1]) if i else None
        language = info.split()[0] if info else ""
        kind, reason = (mark.group(1), mark.group(2)) if mark else (None, "")
        found.append(Block(page, i + 1, language, "\n".join(body) + "\n", kind, reason))
        i = end + 1
    return found


ALL = [block for path in PAGES for block in blocks(path)]
EXAMPLES = [b for b in ALL if b.language in EXAMPLE_LANGUAGES]


def _run_here(block: Block) -> bool:
    """Run by `test_python_examples_run` or `test_bash_examples_run` (not the server ones)."""
    return block.mark != "not run" and block.reason not in ("server", "with server")


def _with_servers() -> list:
    """Each `run: server` block with the `run: with server` blocks after it on its page."""
    groups: list[list[Block]] = []
    for b in EXAMPLES:
        if b.reason == "server":
            groups.append([b])
        elif b.reason == "with server":
            assert groups and groups[-1][0].page == b.page, f"{b.page}:{b.line}: no server block before it"
            groups[-1].append(b)
    return [pytest.param(g, id=f"{g[0].page}:{g[0].line}", marks=[pytest.mark.slow]) for g in groups]


def _slow(block: Block) -> bool:
    return block.mark == "run" and block.reason == "slow"


def test_every_fence_names_its_language():
    untagged = [f"{b.page}:{b.line}" for b in ALL if not b.language]
    assert not untagged, f"fences without a language (tag them `bash`, `python` or `text`): {untagged}"


def test_marks_are_known_and_stand_before_examples():
    for b in ALL:
        if b.mark == "run":
            assert b.reason in RUN_REASONS, f"{b.page}:{b.line}: the run marks are {RUN_REASONS}"
        if b.reason == "server":
            assert b.language == "bash" and b.code.startswith("radixkv serve "), f"{b.page}:{b.line}"
        if b.mark:
            assert b.language in EXAMPLE_LANGUAGES, f"{b.page}:{b.line}: a mark before a {b.language} block"
        if b.mark == "not run":
            assert b.reason, f"{b.page}:{b.line}: `not run` needs its reason"


def test_blocks_not_run_are_the_counted_ones():
    counted: dict[str, int] = {}
    for b in EXAMPLES:
        if b.mark == "not run":
            counted[b.page] = counted.get(b.page, 0) + 1
    assert counted == NOT_RUN


def test_readme_keeps_the_test_command_and_does_not_run_it():
    (block,) = [b for b in EXAMPLES if b.page == "README.md" and b.code.strip() == TEST_COMMAND]
    assert block.mark == "not run"


def _python_pages() -> list:
    pages = {}
    for b in EXAMPLES:
        if b.language == "python" and _run_here(b):
            pages.setdefault(b.page, []).append(b)
    return [
        pytest.param(page, found, id=page, marks=[pytest.mark.slow] if any(map(_slow, found)) else [])
        for page, found in pages.items()
    ]


def _bash_blocks() -> list:
    return [
        pytest.param(b, id=f"{b.page}:{b.line}", marks=[pytest.mark.slow] if _slow(b) else [])
        for b in EXAMPLES
        if b.language == "bash" and _run_here(b)
    ]


# Runs a page's blocks in one namespace; each block compiled on its own, so a traceback names it.
DRIVER = """
import ast, asyncio, json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
async def main():
    for name, code in blocks:
        result = eval(compile(code, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), namespace)
        if asyncio.iscoroutine(result):
            await result
asyncio.run(main())
"""


def _env() -> dict[str, str]:
    """The examples' environment: one OpenMP thread, no GPU, this environment's `radixkv` and
    `python` first on the PATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _folder(tmp_path: Path, code: str = "") -> Path:
    """A bash block's working folder (see the module); skips the test when `code` names a
    public trace that is not here."""
    shutil.copytree(ROOT / "workloads", tmp_path / "workloads")
    for name in PUBLIC_TRACES:
        if name in code:
            trace = shared_trace(name)
            if not trace.exists():
                pytest.skip(f"{name} is not present (shared/traces/)")
            (tmp_path / name).symlink_to(trace)
    return tmp_path


def _run_bash(code: str, where: str, folder: Path, timeout_s: float = TIMEOUT_S) -> None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=folder,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, f"{where} failed:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _run_python(
    blocks: list[tuple[str, str]], where: str, folder: Path, timeout_s: float = TIMEOUT_S
) -> None:
    """`blocks` (name, code) in order, in one namespace of one fresh interpreter (`DRIVER`)."""
    script = folder / "blocks.json"
    script.write_text(json.dumps(blocks))
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(script)],
        cwd=folder,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, f"{where}'s examples failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.mark.parametrize(("page", "found"), _python_pages())
def test_python_examples_run(page: str, found: list[Block], tmp_path: Path):
    timeout_s = SLOW_TIMEOUT_S if any(map(_slow, found)) else TIMEOUT_S
    _run_python([(f"{b.page}:{b.line}", b.code) for b in found], page, _folder(tmp_path), timeout_s)


@pytest.mark.parametrize("block", _bash_blocks())
def test_bash_examples_run(block: Block, tmp_path: Path):
    timeout_s = SLOW_TIMEOUT_S if _slow(block) else TIMEOUT_S
    _run_bash(block.code, f"{block.page}:{block.line}", _folder(tmp_path, block.code), timeout_s)


@pytest.mark.parametrize("group", _with_servers())
def test_server_examples_run(group: list[Block], tmp_path: Path):
    server, clients = group[0], group[1:]
    port = str(free_port())
    folder = _folder(tmp_path)
    command = server.code.replace(f"--port {DOC_PORT}", f"--port {port}").strip()
    assert f"--port {port}" in command, f"{server.page}:{server.line}: the server must take --port {DOC_PORT}"
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], cwd=folder, env=_env(), stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the documented server did not start"
            time.sleep(0.3)
        here = [
            (f"{b.page}:{b.line}", b.language, b.code.replace(f":{DOC_PORT}", f":{port}")) for b in clients
        ]
        for where, language, code in here:
            if language == "bash":
                _run_bash(code, where, folder)
        python = [(where, code) for where, language, code in here if language == "python"]
        if python:
            _run_python(python, f"{server.page}:{server.line}", folder)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, log_path.read_text()[-4000:]
