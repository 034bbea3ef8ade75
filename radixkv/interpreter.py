"""How radixkv starts a Python child: this interpreter, without the working directory on
`sys.path`.

Why. `python -m` and `python -c` put the working directory first on a child's `sys.path`, and a
child started in a checkout of this repository would then import the checkout's top-level
`kernels/` folder (the source of `radixkv.kernels`) wherever another package imports a top-level
`kernels`: transformers 5.25 and later import Hugging Face's `kernels` package at startup, so
such a child would fail to import transformers. `-P` (Python 3.11 and later) leaves the working
directory out; the child finds radixkv where it is installed, as any other package.

Only children started through `python_argv` are covered. Ray adds its driver's working directory
to every replica's path, and a process started as `python -m` or `-c` in the checkout (a user's
front end, and the tensor-parallel workers and cores that take its path) has it too, so
`pyproject.toml` keeps transformers below 5.25.
"""

from __future__ import annotations

import sys


def python_argv(*args: str) -> list[str]:
    """`[sys.executable, "-P", *args]`; without `-P` on Python 3.10, which lacks it (there a child
    started in the checkout's root still sees the checkout's folders)."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, *args]
