"""`radixkv replay --restart-after-turn`: the report's shape and sense on a tiny workload whose
sessions share nothing, so whatever a restarted engine finds it found in the store; in process,
and against a real server that `--restart-command` restarts on the same port."""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import json
import os
import random
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from processes import exited
from redis_server import free_port
from restartable_server import start, stop

from radixkv.cli import main
from radixkv.config import EngineConfig
from radixkv.tools.replay_http import Server
from radixkv.tools.replay_restart import replay_restart, restart_section, wait_for_restart
from radixkv.workloads.format import Session, Turn, read_workload, write_workload

ARM_FIELDS = {"turns", "ttft_p50_s", "ttft_p90_s", "hit_rate"}


@pytest.fixture
def workload(tmp_path):
    """Three sessions of three turns, each with a system prompt of its own (40 ids: ten blocks)."""
    rng = random.Random(1)
    sessions = [
        Session(
            f"s{i}",
            [Turn([rng.randrange(256) for _ in range(6)], 4, think=0.01) for _ in range(3)],
            arrival=0.01 * i,
            system=[rng.randrange(256) for _ in range(40)],
        )
        for i in range(3)
    ]
    path = tmp_path / "own_histories.jsonl"
    write_workload(path, sessions, {"generator": "test"})
    return path


def test_a_restart_over_the_store_keeps_what_a_cold_restart_loses(model_folders, workload, tmp_path):
    report_path = tmp_path / "report.json"
    args = [
        "replay",
        str(workload),
        "--model",
        str(model_folders["llama"]),
        "--block-size",
        "4",
        "--kv-cache-memory",
        "4MiB",
        "--speed",
        "4",
        "--restart-after-turn",
        "2",
        "--compare",
        "--report",
        str(report_path),
    ]
    assert main(args) == 0
    section = json.loads(report_path.read_text())["restart"]
    assert section["after_turn"] == 2
    store, cold, none = section["store"], section["cold"], section["none"]
    for arm in (store, cold, none):
        assert arm.keys() >= ARM_FIELDS
        assert arm["turns"] == 3  # the third turn of each session
        assert 0 < arm["ttft_p50_s"] <= arm["ttft_p90_s"]
    # Turn 3's prompt is 66 ids; turn 2 left 59 of them computed (its last reply token's KV is
    # not), the device cache keeps all 59, the store only its 14 full blocks: 56.
    assert none["hit_rate"] == pytest.approx(59 / 66)
    assert store["hit_rate"] == store["store_hit_rate"] == pytest.approx(56 / 66)
    assert cold["hit_rate"] == 0  # a new process: nothing of the first engine, and no sharing
    assert store["same_tokens"] and cold["same_tokens"]


def test_the_second_part_runs_in_a_new_process_without_the_first_ones_memory(model_folders, workload):
    config = EngineConfig(model=str(model_folders["llama"]), block_size=4, kv_cache_memory="4MiB")
    run = replay_restart(read_workload(workload), config, 2, arms=("cold",), speed=4.0)
    second = run.parts["cold"]
    assert run.first_pids["cold"] == os.getpid() != second.pid
    # Its first turn found nothing: the blocks part one left behind died with its engine.
    assert second.result.metrics["prefix_cache_hits"] == 0
    assert restart_section(run)["store"] is None and restart_section(run)["none"] is None


def test_a_cut_after_every_session_ends_is_a_clear_error(model_folders, workload):
    config = EngineConfig(model=str(model_folders["llama"]), block_size=4, kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="no session has more than 3 turns"):
        replay_restart(read_workload(workload), config, 3)


def test_a_resumed_conversation_sends_the_prompt_the_original_would():
    from radixkv.conversation import Conversation

    original = Conversation(None, [1, 2])
    original.prompt([3])
    original.add_reply([4, 5])
    resumed = Conversation.resumed(None, [1, 2], [[3]], original.replies)
    assert resumed.prompt([6]) == original.prompt([6]) == [1, 2, 3, 4, 5, 6]


def wait_healthy(url: str, log: Path, pid: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert not exited(pid), log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


@pytest.mark.slow  # two servers started and restarted, some 11 s each
@pytest.mark.parametrize("store", [True, False], ids=["store", "cold"])
def test_a_replay_restarts_a_server_after_turn_k_and_reports_the_later_turns(
    model_folders, workload, tmp_path, store
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model", str(model_folders["llama"]), "--port", str(port), "--block-size", "4"]
    args += ["--kv-cache-memory", "4MiB"]
    if store:
        args += ["--kv-store", f"file://{tmp_path / 'store'}"]
    pid_file, log = tmp_path / "server.pid", tmp_path / "server.log"
    first = start(pid_file, log, args)
    try:
        wait_healthy(url, log, first.pid)
        before = httpx.get(f"{url}/version").json()["instance"]
        restart = shlex.join(
            [
                sys.executable,
                str(Path(__file__).parent / "restartable_server.py"),
                str(pid_file),
                str(log),
                *args,
            ]
        )
        report_path = tmp_path / "report.json"
        argv = [
            "replay",
            str(workload),
            "--url",
            f"{url}/v1",
            "--speed",
            "4",
            "--restart-after-turn",
            "2",
            "--restart-command",
            restart,
            "--report",
            str(report_path),
        ]
        assert main(argv) == 0
        assert int(pid_file.read_text()) != first.pid and first.wait(timeout=60) == 0  # stopped cleanly
        assert httpx.get(f"{url}/version").json()["instance"] != before
        section = json.loads(report_path.read_text())["restart"]
        arm, other = ("store", "cold") if store else ("cold", "store")
        assert section["after_turn"] == 2 and section[other] is None and section["none"] is None
        later = section[arm]
        assert later["turns"] == 3 and later["failed_requests"] == 0
        # As in process: turn 3's prompt is 66 ids, the store holds turn 2's 14 full blocks (56
        # ids); without the store the new server has nothing, the sessions sharing no prefix.
        expected = 56 / 66 if store else 0.0
        assert later["hit_rate"] == later["store_hit_rate"] == pytest.approx(expected)
    finally:
        stop(int(pid_file.read_text()))
        if first.poll() is None:
            stop(first.pid)
        first.wait(timeout=60)


class _Versioned(http.server.BaseHTTPRequestHandler):
    """/health answers 200; /version names the server's `instance` when it has one."""

    def do_GET(self) -> None:
        instance = self.server.instance  # type: ignore[attr-defined]
        body = {"status": "ok"} if self.path == "/health" else {"version": "0", **instance}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def _versioned(port: int, instance: dict) -> Iterator[None]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Versioned)
    httpd.instance = instance  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.mark.parametrize("names", [True, False], ids=["new-instance", "down-then-up"])
def test_the_wait_for_a_restart_ends_only_once_a_new_server_answers(names):
    port = free_port()
    server = Server(f"http://127.0.0.1:{port}/v1")
    old, new = ({"instance": "a"}, {"instance": "b"}) if names else ({}, {})
    waited = concurrent.futures.ThreadPoolExecutor(1)
    with _versioned(port, old):
        before = server.instance()
        assert before == ("a" if names else None)
        waiting = waited.submit(wait_for_restart, server, before, 60.0)
        time.sleep(1.0)
        assert not waiting.done()  # the old server still answers: no restart yet
    time.sleep(0.5)  # down
    with _versioned(port, new):
        waiting.result(timeout=60)
    waited.shutdown()


def test_a_wait_for_a_restart_that_never_comes_gives_up():
    port = free_port()
    with _versioned(port, {"instance": "a"}), pytest.raises(TimeoutError, match="restarted"):
        wait_for_restart(Server(f"http://127.0.0.1:{port}/v1"), "a", wait_s=1.0)
