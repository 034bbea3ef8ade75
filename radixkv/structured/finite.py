"""Whether a JSON schema has any finite value: a schema whose every value contains itself
(`{"$ref": "#"}`, or an object that requires a property of its own type) compiles, but a
grammar for it can only open brackets until `max_tokens` runs out, so the server refuses it.

The check is the least fixed point of "can be built": a `$ref` target can be built once its
schema can be built from the targets already known to be buildable, starting from none. A
schema can be built when one of its types can: an object when each required property can, an
array when its first `minItems` items can, any other type always; `allOf` needs every part,
`anyOf` and `oneOf` one. Keywords it does not know are taken as buildable: the check only
refuses what is certainly infinite, and leaves other unsatisfiable schemas to llguidance,
which reports them as it compiles.
"""

from __future__ import annotations

from typing import Any

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def has_finite_value(schema: Any) -> bool:
    """True unless every value `schema` (a parsed JSON schema) admits is infinitely deep."""
    built: set[str] = set()
    refs = _refs(schema)
    while True:
        new = {ref for ref in refs - built if _buildable(_resolve(schema, ref), schema, built)}
        if not new:
            return _buildable(schema, schema, built)
        built |= new


def _buildable(node: Any, root: Any, built: set[str]) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict):
        return True  # `true`, or a reference that does not resolve (llguidance refuses it)
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in built:
        return False
    if "const" in node or "enum" in node:
        return True  # a literal, written out as it is
    parts = [node.get("allOf"), node.get("anyOf"), node.get("oneOf")]
    if isinstance(parts[0], list) and not all(_buildable(p, root, built) for p in parts[0]):
        return False
    for alternatives in parts[1:]:
        if isinstance(alternatives, list) and not any(_buildable(p, root, built) for p in alternatives):
            return False
    kinds = node.get("type", TYPES)
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return any(_type_buildable(node, kind, root, built) for kind in kinds)


def _type_buildable(node: dict, kind: Any, root: Any, built: set[str]) -> bool:
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(_buildable(properties.get(name, extra), root, built) for name in required)
    if kind == "array":
        count = node.get("minItems", 0)
        count = count if isinstance(count, int) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        items = node.get("items", True)
        needed = prefix[:count] + ([items] if count > len(prefix) else [])
        return all(_buildable(item, root, built) for item in needed)
    return True


def _refs(node: Any) -> set[str]:
    """Every local reference (`#...`) written anywhere in `node`."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        found = {ref} if isinstance(ref, str) and ref.startswith("#") else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local reference points at (a JSON pointer after `#`), or None."""
    node = root
    for token in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else ():
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node
