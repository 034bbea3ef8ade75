"""How a token is spelled in logprobs: its text, its own bytes, or its id.

A token's decoded text is not always the token: a byte-level token that is only part of a UTF-8
character decodes to "\\ufffd", so two such tokens would share one key of a `top_logprobs` dict
(one overwriting the other) and the chat `bytes` field would hold the UTF-8 of "\\ufffd". Such a
token is spelled as vLLM spells it, `bytes:` and its bytes escaped (`bytes:\\xe2\\x80`), and its
`bytes` are its own: read from the byte-level alphabet (GPT-2 style BPE) or a `<0xNN>` byte
fallback (SentencePiece). With `return_tokens_as_token_ids`, or a model without a tokenizer,
every token is `token_id:N`.
"""

from __future__ import annotations

import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

_CHAR_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"


class TokenSpeller:
    """Spells the tokens of one tokenizer (None: ids only); remembers what it has spelled."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids or tokenizer is None
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        """The token as shown: its decoded text, its `bytes:` spelling when that text is not the
        token (see the module), or `token_id:N`."""
        if self.as_ids:
            return f"token_id:{token_id}"
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if REPLACEMENT in text:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in self.bytes(token_id))
            self._texts[token_id] = text
        return text

    def bytes(self, token_id: int) -> bytes:
        """The token's own bytes (for `token_id:N` spelling: those of the spelling)."""
        if self.as_ids:
            return f"token_id:{token_id}".encode()
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._own_bytes(token_id)
            self._bytes[token_id] = raw
        return raw

    def _own_bytes(self, token_id: int) -> bytes:
        text = self.tokenizer.decode([token_id])
        if REPLACEMENT not in text:
            return text.encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            if piece and all(c in _CHAR_TO_BYTE for c in piece):
                return bytes(_CHAR_TO_BYTE[c] for c in piece)
        return text.encode()

    def top(self, pairs: list[tuple[int, float]]) -> dict[str, float]:
        """`top_logprobs` of completions, token -> logprob; two tokens never share a key (a
        remaining clash of texts falls back to `token_id:N`)."""
        out: dict[str, float] = {}
        for token_id, logprob in pairs:
            key = self.text(token_id)
            out[f"token_id:{token_id}" if key in out else key] = logprob
        return out
