"""A `radixkv serve` process that a shell command can restart on the same port, as a user would:
`python tests/restartable_server.py PID_FILE LOG ARGS...` stops the server whose pid is in
PID_FILE, waits for it to exit, and starts `radixkv serve ARGS...` in its place, in a session of
its own, writing the new pid there. It does not wait for the new server to answer: that is the
caller's to check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from processes import exited

ROOT = Path(__file__).resolve().parent.parent


def start(pid_file: Path, log: Path, args: list[str]) -> subprocess.Popen:
    """`radixkv serve ARGS` (from this checkout), logging to `log`; its pid written to `pid_file`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixkv.cli", "serve", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    pid_file.write_text(str(proc.pid))
    return proc


def stop(pid: int, timeout_s: float = 120.0) -> None:
    """SIGTERM, then waits for the exit; raises if it does not come."""
    if exited(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while not exited(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"server {pid} did not exit")
        time.sleep(0.1)


if __name__ == "__main__":
    pid_path, log_path, *serve_args = sys.argv[1:]
    stop(int(Path(pid_path).read_text()))
    start(Path(pid_path), Path(log_path), serve_args)
