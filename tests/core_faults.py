"""Core setups for tests of an engine core in its own process (`AsyncEngine(core_setup=...)`):
importable by name in the child, since the child unpickles them (a core has its front end's
`sys.path`)."""

from __future__ import annotations

import json
import os
import time

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


def write_surroundings(core) -> None:
    """Writes `surroundings.json` into the core's working directory: that directory, the core's
    `RADIXKV_TEST_MARK` variable and its pid."""
    seen = {"cwd": os.getcwd(), "mark": os.environ.get("RADIXKV_TEST_MARK"), "pid": os.getpid()}
    with open("surroundings.json", "w") as f:
        json.dump(seen, f)


SLOW_STEP_S = 0.5


def slow_forward(core) -> None:
    """Every forward takes at least `SLOW_STEP_S` (a long step, as a long prefill on a GPU)."""
    real = core.runner.forward

    def forward(batch):
        time.sleep(SLOW_STEP_S)
        return real(batch)

    core.runner.forward = forward


def forbid_decoding(core) -> None:
    """The core's tokenizer decode raises: a core that detokenized (to find stop strings, say)
    would fail its requests. The front end finds stop strings itself."""

    def decode(ids):
        raise AssertionError("the engine core decoded tokens")

    core.inputs.decode = decode
