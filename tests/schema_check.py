"""A small JSON Schema (2020-12) validator for the schemas gpuguard publishes: the keywords
gpuguard.document emits and nothing else (`jsonschema` is not a dependency). A keyword it
does not know is an error, never skipped, so a schema cannot pass by being misunderstood."""
from __future__ import annotations

from typing import Any

ANNOTATIONS = {"$schema", "$id", "title", "description", "$defs"}
TYPES = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
KNOWN = ANNOTATIONS | {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "anyOf", "$ref"}


def errors(schema: dict[str, Any], doc: Any) -> list[str]:
    """Every place where `doc` breaks `schema`, as "path: what"; [] when it is valid."""
    out: list[str] = []
    _check(schema, doc, "$", schema, out)
    return out


def _check(s: dict[str, Any], v: Any, at: str, root: dict[str, Any], out: list[str]) -> None:
    unknown = set(s) - KNOWN
    if unknown:
        raise ValueError(f"{at}: schema keywords this checker does not know: {sorted(unknown)}")
    if "$ref" in s:
        ref = s["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"{at}: only local $defs references are supported, not {ref!r}")
        _check(root["$defs"][ref[len("#/$defs/"):]], v, at, root, out)
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(TYPES[t](v) for t in types):
            out.append(f"{at}: {v!r:.60} is not {' or '.join(types)}")
            return
    if "const" in s and not _same(v, s["const"]):
        out.append(f"{at}: {v!r:.60} is not {s['const']!r}")
    if "enum" in s and not any(_same(v, e) for e in s["enum"]):
        out.append(f"{at}: {v!r:.60} is not one of {s['enum']}")
    if "anyOf" in s:
        if not any(not errors({**sub, "$defs": root.get("$defs", {})}, v) for sub in s["anyOf"]):
            out.append(f"{at}: {v!r:.60} matches none of {len(s['anyOf'])} alternatives")
    if isinstance(v, dict):
        props = s.get("properties", {})
        for key in s.get("required", ()):
            if key not in v:
                out.append(f"{at}: missing key {key!r}")
        for key, item in v.items():
            if key in props:
                _check(props[key], item, f"{at}.{key}", root, out)
            elif s.get("additionalProperties") is False:
                out.append(f"{at}: key {key!r} is not in the schema")
            elif isinstance(s.get("additionalProperties"), dict):
                _check(s["additionalProperties"], item, f"{at}.{key}", root, out)
    if isinstance(v, list) and "items" in s:
        for i, item in enumerate(v):
            _check(s["items"], item, f"{at}[{i}]", root, out)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b
