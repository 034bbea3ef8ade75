"""Core setups for tests of an engine core in its own process (`AsyncEngine(core_setup=...)`):
importable by name in the child, since the child unpickles them (tests put this folder on its
PYTHONPATH)."""

from __future__ import annotations

POISON = 255
"""A prompt holding this token fails every step it is in."""


def poison_forward(core) -> None:
    """The runner's forward raises for any batch holding a request whose prompt has `POISON`."""
    real = core.runner.forward

    def forward(batch):
        if any(POISON in item.request.prompt_ids for item in batch):
            raise RuntimeError("poisoned forward")
        return real(batch)

    core.runner.forward = forward


def break_the_books(core) -> None:
    """After its first step that holds a block, one block's refcount is one too many: the core's
    `check_invariants` must say so."""

    def corrupt(_core) -> None:
        held = [b for b in range(core.pool.num_blocks) if core.pool.refcount(b)]
        if held and core.step_hooks[-1] is corrupt:
            core.pool._refcount[held[0]] += 1
            core.step_hooks.remove(corrupt)

    core.step_hooks.append(corrupt)
