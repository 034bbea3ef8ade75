"""How radixkv starts a Python child: this interpreter, without the working directory on
`sys.path`.

Why. `python -m` and `python -c` put the working directory first on a child's `sys.path`, so a
folder there named as a package the child imports would be imported in its place (a user's
`kernels/` instead of Hugging Face's `kernels`, which transformers 5.25 and later import as they
build a model). `-P` (Python 3.11 and later) leaves the working directory out; the child finds
radixkv and its dependencies where they are installed. A checkout of this repository holds no
such folder (radixkv's kernels and scheduler are inside `radixkv/`), so started there a child is
safe either way (`tests/test_layout.py`).

Only children started through `python_argv` are covered: Ray adds its driver's working directory
to every replica's path, and a process started as `python -m` or `-c` has it too.
"""

from __future__ import annotations

import sys


def python_argv(*args: str) -> list[str]:
    """`[sys.executable, "-P", *args]`; without `-P` on Python 3.10, which lacks it (there a child
    started in the checkout's root still sees the checkout's folders)."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, *args]
