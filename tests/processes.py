"""The machine's processes as Linux's `/proc` shows them, for tests that check which processes a
component starts and what it leaves behind once closed, killed or orphaned."""

from __future__ import annotations

import contextlib
import os


def state_and_parent(pid: int | str) -> tuple[str, int]:
    """Process `pid`'s state letter ("Z" for a zombie) and parent pid; OSError once it is reaped.
    The name in parentheses may hold spaces and parentheses: the fields follow the last ")"."""
    with open(f"/proc/{pid}/stat") as stat:
        state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
    return state, int(parent)


def processes() -> dict[int, tuple[str, int]]:
    """Every process now: pid -> (state letter, parent pid). One that ends while we look is left out."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                found[int(entry)] = state_and_parent(entry)
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` and that have not exited."""
    return [child for child, (state, parent) in processes().items() if parent == pid and state != "Z"]


def exited(pid: int) -> bool:
    """Whether `pid` has ended: reaped, or a zombie not reaped yet (an orphan's zombie waits for
    whatever adopted it, which in a container may never reap)."""
    try:
        return state_and_parent(pid)[0] == "Z"
    except OSError:
        return True


def reaped(pid: int) -> bool:
    """Whether `pid` has ended and its parent has collected it: no zombie left. Stricter than
    `exited`, for processes whose parent is ours to check (a worker never joined stays a zombie)."""
    return not os.path.exists(f"/proc/{pid}")
