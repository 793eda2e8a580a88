"""A minimal JSON-Schema checker for needlescope's artifacts (no dependency, no torch).

Supports ``type`` (one name or a list), ``required``, ``properties``, ``additionalProperties``
(a schema for every other key's value), ``items``, ``minItems`` and ``minLength``. A Python
bool is a JSON ``boolean`` only, never an ``integer`` or ``number``.
"""

from __future__ import annotations

__all__ = ["check_schema", "record"]

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "null": type(None),
}


def _is(obj: object, name: str) -> bool:
    if name == "boolean":
        return isinstance(obj, bool)
    return not isinstance(obj, bool) and isinstance(obj, _TYPES[name])


def check_schema(obj: object, schema: dict, path: str) -> None:
    """ValueError naming the JSON path of the first place where ``obj`` breaks ``schema``."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(_is(obj, t) for t in names):
            raise ValueError(f"{path}: expected {names}, got {type(obj).__name__}")
    if isinstance(obj, dict):
        for key in schema.get("required", []):
            if key not in obj:
                raise ValueError(f"{path}: missing key {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in obj:
                check_schema(obj[key], sub, f"{path}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                if key not in schema.get("properties", {}):
                    check_schema(value, extra, f"{path}.{key}")
    if isinstance(obj, list) and len(obj) < schema.get("minItems", 0):
        raise ValueError(f"{path}: expected at least {schema['minItems']} item(s), got {len(obj)}")
    if isinstance(obj, str) and len(obj) < schema.get("minLength", 0):
        raise ValueError(
            f"{path}: expected a non-empty string" if schema["minLength"] == 1 else f"{path}: too short"
        )
    if isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            check_schema(item, schema["items"], f"{path}[{i}]")


def record(properties: dict, *, optional: tuple[str, ...] = ()) -> dict:
    """An object schema whose every property is required unless named in ``optional``.

    Derives ``required`` from ``properties`` so that a key added to one cannot be forgotten in
    the other.
    """
    unknown = set(optional) - set(properties)
    if unknown:
        raise ValueError(f"optional names no property: {sorted(unknown)}")
    return {
        "type": "object",
        "required": [k for k in properties if k not in optional],
        "properties": properties,
    }
