"""A bounded excerpt of a value, for error messages that quote what the caller sent.

A message that reprints a rejected value lets a client make the server echo as much as it
uploads (10,000 stop strings made a 149,029-byte error body). Messages quote `excerpt(value)`
instead: the value's `repr`, cut to `limit` characters with how long the whole was, so a
message stays a few hundred bytes whatever was sent. `repr` escapes control characters, so
the excerpt is printable text.
"""

from __future__ import annotations

EXCERPT_CHARS = 120


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """`repr(value)`, or its first `limit` characters followed by `... (N characters)`."""
    text = _bounded_repr(value, limit)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({_size(value)})"


def _bounded_repr(value: object, limit: int) -> str:
    """The repr, built from a prefix only for long strings and containers: a 1 MB string or a
    list of 10,000 strings is not copied whole just to be cut."""
    if isinstance(value, str | bytes) and len(value) > limit:
        return repr(value[: limit + 1])
    if isinstance(value, list | tuple) and len(value) > limit:
        return repr(value[: limit + 1])
    if isinstance(value, dict) and len(value) > limit:
        return repr(dict(list(value.items())[: limit + 1]))
    return repr(value)


def _size(value: object) -> str:
    if isinstance(value, str):
        return f"{len(value)} characters"
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    if isinstance(value, list | tuple | dict):
        return f"{len(value)} items"
    return "cut"
