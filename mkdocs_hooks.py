"""MkDocs hook: let the API reference read `radixkv.kernels` and `radixkv.scheduler` from source.

The checkout keeps them in the top-level folders `kernels/` and `scheduler/`, which the install maps
inside `radixkv` (pyproject's `package-dir`). mkdocstrings reads the source without importing it and
finds subpackages by folder, so while those folders sit at the top, this builds the installed layout
out of symbolic links in a temporary folder and points mkdocstrings there. Once they live under
`radixkv/`, the hook does nothing.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent
MAPPED = ("kernels", "scheduler")


@event_priority(100)  # before mkdocstrings reads its handlers' options
def on_config(config):
    if all((ROOT / "radixkv" / name).is_dir() or not (ROOT / name).is_dir() for name in MAPPED):
        return config
    layout = Path(tempfile.mkdtemp(prefix="radixkv-docs-"))
    atexit.register(shutil.rmtree, layout, ignore_errors=True)
    package = layout / "radixkv"
    package.mkdir()
    for entry in (ROOT / "radixkv").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in MAPPED:
        if not (package / name).exists():
            (package / name).symlink_to(ROOT / name)
    handler = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    handler["paths"] = [str(layout)]
    return config
