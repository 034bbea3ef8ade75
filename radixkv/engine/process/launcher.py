"""Engine cores started in a fraction of a second: a launcher process that has imported the
engine once forks each core.

Why. A fresh interpreter spends seconds importing torch, transformers and Triton before it can
build a core (5.7 s a start on this project's 2-core CI machine, most of a test server's life).
The front end cannot fork itself (its threads may hold locks a child would inherit), and
multiprocessing's forkserver imports the caller's main module again in every child, which runs a
script without a `__main__` guard twice. So a front end starts one launcher
(`python -P -m radixkv.engine.process.launcher`: see `radixkv.interpreter`) at its first core
and keeps it: the launcher imports the core's modules, then serves requests one at a time. Each
request carries the front end's working directory, environment and `sys.path` (so a core sees
what a fresh child would) and the core's arguments; the launcher forks, the child becomes the
core (`core_process.main`), and the launcher answers with the child's pid. It reaps its children
and reports each exit status, which `CoreHandle` shows as `subprocess.Popen` shows a child's.

Lifetime. The launcher ignores SIGINT and SIGTERM, as cores do (the front end stops its cores in
order), and ends at EOF on its request pipe: when the front end exits, however it dies (a child
the front end forks lets go of that pipe at the fork). A core watches the front end itself
(`core_process`), so none outlives it either.

Wire: a request is a 4-byte little-endian length and a pickle; a report is `REPORT` (b"S" and
the pid of a core started, or b"X", a pid and its exit code), on a pipe of its own so that the
cores' prints on stdout go where the front end's go.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from radixkv.interpreter import python_argv

REPORT = struct.Struct("<cqq")  # kind, pid, exit code
LENGTH = struct.Struct("<I")
START_TIMEOUT_S = 60.0  # a fork and its answer; the core's own start is CoreClient's to wait for
UNKNOWN_EXIT = 1  # a core whose launcher is gone has no status to report
LOOK_S = 0.2  # how often a wait looks at a core's sentinel once its launcher is gone
PRELOAD = ("radixkv.engine.core", "radixkv.engine.process.core_process")  # what every core imports


class CoreHandle:
    """A core the launcher started, with `subprocess.Popen`'s `pid`, `poll`, `wait`, `kill` and
    `returncode`; `sentinel` is a descriptor readable once it exits (Linux's pidfd), or None."""

    def __init__(self, launcher: Launcher, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._launcher = launcher
        try:
            self.sentinel: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not Linux, or already reaped (its status is reported)
            self.sentinel = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.exit_code(self.pid, self._exited())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; raises `subprocess.TimeoutExpired` after `timeout` seconds."""
        if self.returncode is None:
            self.returncode = self._launcher.wait_exit(self.pid, timeout, self._exited)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is not None:
            return  # never signal a pid that may have been handed to another process
        with contextlib.suppress(ProcessLookupError):  # reaped, its report not yet read
            if self.sentinel is not None:
                signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """Closes the sentinel (the handle's only resource)."""
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None

    def _exited(self) -> bool:
        """Whether the process has ended, by its sentinel: what tells when the launcher that
        would report it is gone."""
        if self.sentinel is None:
            return False
        return bool(select.select([self.sentinel], [], [], 0)[0])


class Launcher:
    """The front end's side of one launcher process (see the module docstring)."""

    def __init__(self) -> None:
        self._reports, reports_w = os.pipe()
        self.owner = os.getpid()
        try:
            self.process = subprocess.Popen(
                python_argv("-m", __name__, str(reports_w)),
                stdin=subprocess.PIPE,
                pass_fds=(reports_w,),
            )
        except BaseException:
            os.close(self._reports)
            raise
        finally:
            os.close(reports_w)
        self._send_lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._started: queue.Queue[int | None] = queue.Queue()
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="radixkv-launcher", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return not self._gone and self.process.poll() is None

    def let_go(self) -> None:
        """In a forked child: points the inherited pipes' descriptors at /dev/null (see
        `_let_go_in_child`); the report pipe only while the parent's reader still had it open."""
        fds = [self.process.stdin.fileno()] + ([] if self._gone else [self._reports])
        null = os.open(os.devnull, os.O_RDWR)
        for fd in fds:
            os.dup2(null, fd)
        os.close(null)

    def launch(self, core_args: bytes) -> CoreHandle:
        """Forks a core that runs `core_process.main(core_args)` in this process's directory,
        environment and `sys.path`."""
        payload = pickle.dumps((os.getcwd(), dict(os.environ), list(sys.path), core_args))
        with self._send_lock:
            try:
                self.process.stdin.write(LENGTH.pack(len(payload)) + payload)
                self.process.stdin.flush()
            except OSError as e:
                raise RuntimeError("the engine core launcher is gone") from e
            try:
                pid = self._started.get(timeout=START_TIMEOUT_S)
            except queue.Empty:  # stuck: its late answer must not become the next core's
                self.process.kill()
                self.process.wait()
                with self._changed:
                    self._gone = True
                pid = None
        if pid is None:
            raise RuntimeError("the engine core launcher did not start a core")
        return CoreHandle(self, pid)

    def exit_code(self, pid: int, exited: bool) -> int | None:
        with self._changed:
            if pid in self._exits:
                return self._exits.pop(pid)
            return UNKNOWN_EXIT if self._gone and exited else None

    def wait_exit(self, pid: int, timeout: float | None, exited) -> int:
        """Waits for the launcher's report of `pid`'s exit, or, once the launcher is gone, for
        `exited()` (looked at every `LOOK_S`: nothing reports it then)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self._exits:
                if self._gone and exited():
                    return UNKNOWN_EXIT
                left = LOOK_S if deadline is None else min(LOOK_S, deadline - time.monotonic())
                if left <= 0:
                    raise subprocess.TimeoutExpired(f"engine core {pid}", timeout)
                self._changed.wait(left)
            return self._exits.pop(pid)

    def _read(self) -> None:
        while len(record := _read_exactly(self._reports, REPORT.size)) == REPORT.size:
            kind, pid, code = REPORT.unpack(record)
            if kind == b"S":
                with self._changed:  # an earlier process of this pid is reaped: forget its code
                    self._exits.pop(pid, None)
                self._started.put(pid)
            else:
                with self._changed:
                    self._exits[pid] = code
                    self._changed.notify_all()
        with self._changed:
            self._gone = True
            self._changed.notify_all()
        self._started.put(None)
        os.close(self._reports)


_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


def start() -> Launcher:
    """This process's launcher, started if it has none alive (the first core, a launcher that
    died, or a forked front end). It returns at once: a caller about to import the engine itself
    (`radixkv serve`) calls it first, so that both imports run side by side."""
    global _launcher
    with _launcher_lock:
        if _launcher is None or _launcher.owner != os.getpid() or not _launcher.alive():
            _launcher = Launcher()
        return _launcher


def launch(core_args: bytes) -> CoreHandle:
    """Starts a core through this process's launcher (`start`)."""
    return start().launch(core_args)


def _let_go_in_child() -> None:
    """After a fork of the front end (multiprocessing's fork start method, a plain `os.fork`): the
    child lets go of its parent's launcher, whose request pipe it would otherwise hold open, so
    that the launcher still ends at its parent's exit. The pipe's descriptor is pointed at
    /dev/null rather than closed, so that the inherited file object closing it later can never
    close a descriptor that was handed on; the report pipe too while the parent's reader has it
    open. The child starts a launcher of its own if it needs one (`start`), under a fresh lock:
    a thread of the parent's may have held the old one at the fork."""
    global _launcher, _launcher_lock
    _launcher_lock = threading.Lock()
    inherited, _launcher = _launcher, None
    if inherited is not None:
        inherited.let_go()


os.register_at_fork(after_in_child=_let_go_in_child)


# --------------------------------------------------------------- the launcher process


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def _report(fd: int, kind: bytes, pid: int, code: int) -> None:
    with contextlib.suppress(BrokenPipeError):  # the front end is gone; we follow at the next read
        os.write(fd, REPORT.pack(kind, pid, code))


def _reap(reports: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report(reports, b"X", pid, os.waitstatus_to_exitcode(status))


def _become_core(payload: bytes, fds: tuple[int, ...]) -> None:
    """The forked child: drops the launcher's pipes and handlers, takes the front end's
    surroundings, and runs the core. Never returns into the launcher's loop."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in fds:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the launcher's request pipe is not the core's to read
        os.close(devnull)
        cwd, environ, path, core_args = pickle.loads(payload)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        from radixkv.engine.process import core_process

        code = core_process.main(core_args)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the launcher's interpreter state is not ours to tear down


def main(reports: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for module in PRELOAD:
        importlib.import_module(module)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    while True:
        ready = select.select([0, wake_r], [], [])[0]  # a signal's EINTR is retried (PEP 475)
        if wake_r in ready:
            os.read(wake_r, 4096)  # readable: does not block
            _reap(reports)
        if 0 not in ready:
            continue
        header = _read_exactly(0, LENGTH.size)
        if len(header) < LENGTH.size:
            return 0  # EOF: the front end is gone or done
        payload = _read_exactly(0, LENGTH.unpack(header)[0])
        pid = os.fork()
        if pid == 0:
            _become_core(payload, (reports, wake_r, wake_w))
        _report(reports, b"S", pid, 0)
        _reap(reports)  # a core that failed at once


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
