"""JSON documents of frozen value classes, and the JSON Schema those documents follow, both
from one declaration per class, so what is served and what is published cannot drift apart.

A dataclass's document is its fields in order, or, when the class declares `DOCUMENT`, the
keys listed there in that order: a name is a field or a property of the class read under
the same key, a `(key, attribute)` pair reads `attribute` under `key` (`("class",
"class_code")`: `class` is a Python keyword). Values nest: dataclasses become objects,
tuples and lists arrays, mappings objects; None, bool, int, float and str stay as they are.
The schema is read from the same declaration and the type hints of the fields and of the
properties' return values; every key is required (an unknown value is null, never absent)
and no other key is allowed.

Only the standard library: `gpuguard pcie --json` must run on a bare GPU host.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


@functools.cache
def _keys(cls: type) -> tuple[tuple[str, str], ...]:
    declared = cls.__dict__.get("DOCUMENT")
    if declared is None:
        return tuple((f.name, f.name) for f in dataclasses.fields(cls))
    keys = tuple((k, k) if isinstance(k, str) else (k[0], k[1]) for k in declared)
    for key, attr in keys:
        if not hasattr(cls, attr) and attr not in {f.name for f in dataclasses.fields(cls)}:
            raise TypeError(f"{cls.__name__}.DOCUMENT: key {key!r} reads {attr!r}, which the class does not have")
    return keys


def document(value: Any) -> Any:
    """The JSON-ready document of `value` (a dataclass instance, or plain data holding them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {key: document(getattr(value, attr)) for key, attr in _keys(type(value))}
    if isinstance(value, Mapping):
        return {str(k): document(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [document(v) for v in value]
    raise TypeError(f"no JSON document for a {type(value).__name__}: {value!r}")


def json_schema(cls: type, *, title: str, description: str | None = None) -> dict[str, Any]:
    """The JSON Schema (2020-12) of `document(x)` for every `x` of dataclass `cls`."""
    defs: dict[str, dict[str, Any]] = {}
    schema: dict[str, Any] = {"$schema": JSON_SCHEMA_DIALECT, "title": title,
                              **_object_schema(cls, defs, description)}
    if defs:
        schema["$defs"] = dict(sorted(defs.items()))
    return schema


def _doc(obj: Any) -> str | None:
    text = (getattr(obj, "__doc__", None) or "").strip()
    if not text or text.startswith(f"{getattr(obj, '__name__', '')}("):  # dataclass's generated signature
        return None
    return " ".join(text.split("\n\n")[0].split())


def _object_schema(cls: type, defs: dict[str, dict[str, Any]], description: str | None = None) -> dict[str, Any]:
    hints = get_type_hints(cls)
    props: dict[str, Any] = {}
    for key, attr in _keys(cls):
        member = getattr(cls, attr, None)
        if isinstance(member, property):
            tp = get_type_hints(member.fget).get("return")
            if tp is None:
                raise TypeError(f"{cls.__name__}.{attr}: a property in a document needs a return annotation")
            prop = _type_schema(tp, defs)
            if doc := _doc(member):
                prop = {"description": doc, **prop}
        else:
            prop = _type_schema(hints[attr], defs)
        props[key] = prop
    out: dict[str, Any] = {"description": doc} if (doc := description or _doc(cls)) else {}
    return {**out, "type": "object", "properties": props, "required": list(props), "additionalProperties": False}


_SIMPLE = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string"}


def _type_schema(tp: Any, defs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
    if origin in (Union, types.UnionType):
        parts = [_type_schema(a, defs) for a in args]
        if all(set(p) == {"type"} for p in parts):
            return {"type": [p["type"] for p in parts]}
        return {"anyOf": parts}
    if origin in (tuple, list, Sequence) and (origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)):
        return {"type": "array", "items": _type_schema(args[0], defs)}
    if origin in (dict, Mapping):
        return {"type": "object", "additionalProperties": _type_schema(args[1], defs)}
    if dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # placeholder: a class that refers to itself ends here
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    raise TypeError(f"no JSON Schema for the type {tp!r}")
