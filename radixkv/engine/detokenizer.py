"""Text of a growing token sequence, piece by piece, and the stop strings found in it.

Decoding the whole output again for every new token costs O(length) per token. Instead, as in
vLLM, only a short window is decoded: the tokens since the last emitted piece (`read`) and a few
before it (`prefix`) for context, since tokenizers drop or merge spaces at a sequence's start.
The new piece is the window's text past the context's text. A window whose text ends in U+FFFD is
a multi-byte character whose last bytes have not come yet: nothing is emitted until they do, so a
piece never splits a character. The window shrinks back to one token after each piece, which
makes the cost O(1) amortized per token.

Stop strings: text that might be the start of a stop string (its last `max(len(stop)) - 1`
characters) is held back until the next tokens settle it, so a stop string split across tokens
is found and never emitted. Once one is found, the text ends just before it.

Who detokenizes, and when. The two tokenizer decodes of a push cost about 8 us, 2 ms of a
256-sequence decode step (`radixkv bench engine`), so the engine's step pushes only sequences with
stop strings (it must, to end them at the right token); with the core in its own process, the
front end pushes them as each step's tokens arrive (`push_to_stop`) and the core never decodes.
Every other sequence is detokenized where its text is read (`catch_up`), as in vLLM and SGLang,
whose steps append token ids and leave the text to the output side: stream deltas, a finished
request's output, the async engine's caller. Pushing the same tokens late gives the same pieces
as pushing them at once, since a push depends on the token ids alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), start: int = 0) -> None:
        """`decode(ids)` is the tokenizer's; the text is that of the tokens from `start` on (the
        generated ones, after a prompt of `start` tokens)."""
        self._decode = decode
        self._stop = tuple(stop)
        self._start = start
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._prefix = start  # window start: context tokens already emitted
        self._read = start  # tokens whose text is emitted or pending
        self._pending = ""  # decoded text not yet released (a possible stop string's start)
        self._finished = False  # `finish` has run
        self.pieces: list[str] = []  # released text, one entry per token pushed
        self.stopped = False  # a stop string was found; the text ends before it

    def fork(self) -> IncrementalDetokenizer:
        """A fresh detokenizer with the same decoding and stop strings (a parallel sample)."""
        return IncrementalDetokenizer(self._decode, self._stop, self._start)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def push(self, ids: list[int], end: int | None = None) -> None:
        """`ids[:end]` (all of `ids` by default) are all tokens so far, the newest last, one more
        than at the previous push. Appends the text released by the newest token to `pieces`
        ("" while held back)."""
        end = len(ids) if end is None else end
        piece = ""
        if not self.stopped:
            context = self._decode(ids[self._prefix : self._read])
            window = self._decode(ids[self._prefix : end])
            if len(window) > len(context) and not window.endswith(REPLACEMENT_CHAR):
                self._pending += window[len(context) :]
                self._prefix, self._read = self._read, end
                piece = self._release()
        self.pieces.append(piece)

    def catch_up(self, ids: list[int], end: int | None = None) -> None:
        """Pushes, one at a time, the tokens of `ids[:end]` not pushed yet, so that `pieces` has
        one entry per generated token up to `end`."""
        end = len(ids) if end is None else end
        for n in range(self._start + len(self.pieces) + 1, end + 1):
            self.push(ids, n)

    def push_to_stop(self, ids: list[int]) -> int | None:
        """Pushes the tokens of `ids` not pushed yet, one at a time, up to the first whose text
        completes a stop string; returns how many tokens `ids` then has up to and including that
        one, or None when none did (all pushed) or one had already. The front end of a core in its
        own process finds stop strings this way, in the tokens each step sends
        (`radixkv.engine.process`)."""
        if self.stopped:
            return None
        for n in range(self._start + len(self.pieces) + 1, len(ids) + 1):
            self.push(ids, n)
            if self.stopped:
                return n
        return None

    def finish(self, ids: list[int]) -> None:
        """The sequence ended, all of `ids` pushed: releases what was held back (an incomplete
        character's U+FFFD included, as a full decode would show it) onto the last token's piece.
        Later calls do nothing."""
        if self.stopped or not self.pieces or self._finished:
            return
        self._finished = True
        context = self._decode(ids[self._prefix : self._read])
        rest = self._pending + self._decode(ids[self._prefix :])[len(context) :]
        self._pending = ""
        self.pieces[-1] += rest

    def _release(self) -> str:
        pending = self._pending
        cut = min((i for i in (pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return pending[:cut]
        keep = min(self._hold, len(pending))
        self._pending = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]
