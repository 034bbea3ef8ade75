"""Traces for the tests: where the shared public ones are (`shared/traces/` beside the checkout,
or beside the folder that holds the worktree; tests that read them skip cleanly when they are
absent), and seeded random hash-id traces."""

import random
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def shared_trace(name: str) -> Path:
    """The trace's path; a path that does not exist when no `shared/traces/` holds it."""
    for folder in (_ROOT.parent, _ROOT.parent.parent):
        path = folder / "shared" / "traces" / name
        if path.exists():
            return path
    return _ROOT.parent / "shared" / "traces" / name


def random_hash_trace(rng: random.Random, n: int, extend_p: float = 0.7, max_new: int = 8) -> list[list[int]]:
    """Requests that extend earlier ones at random points (with probability `extend_p`) by 1 to
    `max_new` fresh ids, as hash ids name whole prefixes."""
    requests: list[list[int]] = []
    next_id = 0
    for _ in range(n):
        base = rng.choice(requests) if requests and rng.random() < extend_p else []
        ids = base[: rng.randint(0, len(base))]
        for _ in range(rng.randint(1, max_new)):
            ids = [*ids, next_id]
            next_id += 1
        requests.append(ids)
    return requests
