"""What a request asks its output to match: plain data, so it crosses a process boundary as it is.

Exactly one of the fields is set. `json` is a JSON schema (as JSON text), `json_object` any JSON
object, `regex` a regular expression (Rust `regex` syntax, as llguidance takes it), `choice`
one of the given strings exactly, and `grammar` a Lark grammar in llguidance's dialect (which
embeds JSON schemas with `%json {...}`: the server writes tool calls this way). The spec is text
only; the matcher that follows it lives where the sampler runs (`radixkv.structured.grammar`).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

from radixkv.excerpt import excerpt

MAX_SPEC_CHARS = 1 << 20  # a grammar larger than this is refused before any compilation


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):  # kept as a tuple: the spec is a cache key
            object.__setattr__(self, "choice", tuple(self.choice))

    def validate(self) -> None:
        """Raises ValueError naming `structured_outputs` when not exactly one field is set, a
        field has the wrong type, or the spec is larger than `MAX_SPEC_CHARS`. Whether the
        grammar itself compiles is checked by `GrammarCompiler.check`."""
        texts = {"json": self.json, "regex": self.regex, "grammar": self.grammar}
        for name, value in texts.items():
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError(
                f"structured_outputs.json_object must be True or False, got {excerpt(self.json_object)}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, tuple | list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be non-empty strings, got {excerpt(self.choice)}"
            )
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                f"got {given}"
            )
        if sum(len(v) for v in (*texts.values(), *(self.choice or ())) if v) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs is larger than {MAX_SPEC_CHARS} characters")
        if self.json is not None:
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
