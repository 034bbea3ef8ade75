"""Where the shared public traces are: `shared/traces/` beside the checkout (or beside the folder
that holds the worktree). Tests that read them skip cleanly when they are absent."""

from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def shared_trace(name: str) -> Path:
    """The trace's path; a path that does not exist when no `shared/traces/` holds it."""
    for folder in (_ROOT.parent, _ROOT.parent.parent):
        path = folder / "shared" / "traces" / name
        if path.exists():
            return path
    return _ROOT.parent / "shared" / "traces" / name
