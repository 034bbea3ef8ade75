"""One tokenizer object per thread, for a tokenizer that several threads use at once.

The server encodes prompts and renders chat templates in worker threads, detokenizes streams in
its event loop, and the engine's step thread decodes for stop strings; a Hugging Face fast
tokenizer's Rust object is not made for concurrent calls ("Already borrowed" when one call mutates
its truncation or padding state while another runs). A lock would serialize a 10 MB prompt's
encoding with every stream's decoding, so each thread gets its own deep copy instead, made on its
first use (a few milliseconds, once per thread).
"""

from __future__ import annotations

import copy
import threading
from typing import Any


class PerThreadTokenizer:
    """Stands in for `tokenizer`: every attribute and call goes to the calling thread's copy."""

    def __init__(self, tokenizer: Any) -> None:
        self._base = tokenizer
        self._copy_lock = threading.Lock()  # the copy reads the base, which no thread calls
        self._local = threading.local()

    def own(self) -> Any:
        """The calling thread's copy."""
        mine = getattr(self._local, "tokenizer", None)
        if mine is None:
            with self._copy_lock:
                mine = self._local.tokenizer = copy.deepcopy(self._base)
        return mine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.own(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.own()(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.own())
