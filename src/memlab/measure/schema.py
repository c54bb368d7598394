"""summary.json's one definition: the typed record every run, rank and launcher writes, its
``schema_version``, the JSON Schema made from it, and the check every reader can run.

The record is :class:`Summary`: TypedDicts, one per section, each key with its type and a
docstring (units are in the names: ``_bytes``, ``_s``; or in the docstring). An object whose
keys are fixed is closed (a key not defined here is an error); a map whose keys are data (memory
by category or phase, a method's curves, the versions of packages) is a map from names to one
type. What each status must hold beyond the keys every record has is :data:`BY_STATUS`.

``scripts/gen_summary_schema.py`` writes :func:`json_schema` to
``memlab/assets/summary.schema.json`` (shipped in the package; a test fails when it is stale),
and the docs build renders :func:`reference` into the summary.json section of
``docs/measurement.md``. :func:`check` validates a record against the shipped schema with a
small checker of its own (no dependency); :func:`read` takes a record of any version: the
current one is checked as it is, an older one is checked by the rules of its layout and
upgraded (:data:`UPGRADES`), a newer one is refused with the version it has.

A change that adds, removes or retypes a key changes the definition here, bumps
:data:`SCHEMA_VERSION` and adds the upgrade from the previous version to :data:`UPGRADES`.

This module is light (no torch): ``memlab report`` and the sweep launcher import it.
"""
from __future__ import annotations

import json
import sys
import types
import typing
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any, Literal, Union, get_args, get_origin

from memlab.measure.summary_types import (
    BY_STATUS,
    RENAMED,
    SCHEMA_PATH,
    SCHEMA_VERSION,
    Summary,
)

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # (typing_extensions comes with torch)
    from typing_extensions import NotRequired


# ------------------------------------------------------------------------- the JSON Schema

_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean",
           type(None): "null"}


def _hints(cls: type) -> dict[str, tuple[Any, bool]]:
    """``{record key: (type, required)}`` of a TypedDict, in definition order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = {}
    for name, tp in hints.items():
        required = True
        if get_origin(tp) is NotRequired:
            tp, required = get_args(tp)[0], False
        out[RENAMED.get(name, name)] = (tp, required)
    return out


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, dict) and hasattr(tp, "__total__")


def _type_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if tp is Any:
        return {}
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    origin = get_origin(tp)
    if origin is Literal:
        return {"enum": list(get_args(tp))}
    if origin in (Union, types.UnionType):
        parts = [_type_schema(a, defs) for a in get_args(tp)]
        if all(set(p) == {"type"} for p in parts):
            return {"type": [p["type"] for p in parts]}
        return {"anyOf": parts}
    if origin is list:
        return {"type": "array", "items": _type_schema(get_args(tp)[0], defs)}
    if origin is dict:
        key, value = get_args(tp)
        if key is not str:
            raise TypeError(f"summary maps have string keys, not {key}")
        return {"type": "object", "additionalProperties": _type_schema(value, defs)}
    if _is_typeddict(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # (placeholder: a cycle would end here)
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    raise TypeError(f"no JSON Schema for {tp!r}")


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    docs = key_docs(cls)
    props, required = {}, []
    for key, (tp, req) in _hints(cls).items():
        props[key] = {**_type_schema(tp, defs), "description": docs.get(key, "")}
        if req:
            required.append(key)
    return {"type": "object", "description": _doc(cls), "properties": props,
            "required": required, "additionalProperties": False}


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :class:`Summary` at :data:`SCHEMA_VERSION`: every
    fixed-key object closed (``additionalProperties: false``), the keys every record has
    required, and each status's rule (:data:`BY_STATUS`) as an ``if``/``then``."""
    defs: dict[str, Any] = {}
    top = _object_schema(Summary, defs)
    top["properties"]["schema_version"]["const"] = SCHEMA_VERSION
    rules = []
    for status, rule in BY_STATUS.items():
        then: dict[str, Any] = {}
        if rule.required:
            then["required"] = list(rule.required)
        checks: dict[str, Any] = {k: {"not": {"type": "null"}} for k in rule.not_null}
        checks.update({k: {"type": "null"} for k in rule.null})
        if checks:
            then["properties"] = checks
        rules.append({"if": {"properties": {"status": {"const": status}}}, "then": then})
        if rule.job_only:
            rules.append({"if": {"properties": {"status": {"const": status}},
                                 "not": {"required": ["rank"]}},
                          "then": {"required": list(rule.job_only)}})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://memlab/summary.schema.json#v{SCHEMA_VERSION}",
            "title": "memlab summary.json", **top, "allOf": rules,
            "$defs": dict(sorted(defs.items()))}


def schema_text() -> str:
    """:func:`json_schema` as the shipped file holds it."""
    return json.dumps(json_schema(), indent=2) + "\n"


@lru_cache(maxsize=1)
def shipped_schema() -> dict[str, Any]:
    """The schema shipped in the package (:data:`SCHEMA_PATH`)."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------ docs

def _doc(cls: type) -> str:
    import inspect

    return inspect.cleandoc(cls.__doc__ or "")


def key_docs(cls: type) -> dict[str, str]:
    """Each key's docstring (the string right below ``key: type``), read from the source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    docs = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            name = stmt.target.id
            docs[RENAMED.get(name, name)] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _md(text: str) -> str:
    """A docstring's reST markup as Markdown (``x`` and :data:`x` -> `x`), on one line."""
    import re

    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", " ".join(text.split()))
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _type_text(tp: Any) -> str:
    if tp is Any:
        return "any"
    if tp in _SIMPLE:
        return {int: "int", float: "float", str: "str", bool: "bool", type(None): "null"}[tp]
    origin = get_origin(tp)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_text(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_text(get_args(tp)[0])}]"
    if origin is dict:
        return f"map[str, {_type_text(get_args(tp)[1])}]"
    if _is_typeddict(tp):
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    return str(tp)


def reference() -> str:
    """The summary.json section of the docs (``<!-- memlab:summary -->``): each object of the
    record, its keys with their types, whether each is always there, and their docstrings;
    then each status's rule."""
    order: list[type] = []

    def walk(tp: Any) -> None:
        if _is_typeddict(tp):
            if tp in order:
                return
            order.append(tp)
            for sub, _ in _hints(tp).values():
                walk(sub)
        for arg in get_args(tp):
            walk(arg)

    walk(Summary)
    out = [f"`schema_version` {SCHEMA_VERSION}. A key marked *always* is in every record "
           "(null where the type allows it); the others only where they apply. An object "
           "below is closed: no other key is allowed; a `map` holds any names.", ""]
    for cls in order:
        out += [f"### {cls.__name__}", "", _md(_doc(cls)), "",
                "| key | type | | what it is |", "|---|---|---|---|"]
        docs = key_docs(cls)
        for key, (tp, req) in _hints(cls).items():
            doc = _md(docs.get(key, "")).replace("|", "\\|")
            out.append(f"| `{key}` | {_type_text(tp)} | {'always' if req else ''} | {doc} |")
        out.append("")
    out += ["### By status", "", "| status | must hold | not null | null | a job's record (not "
            "a rank's) also holds |", "|---|---|---|---|---|"]
    for status, rule in BY_STATUS.items():
        cells = [", ".join(f"`{k}`" for k in keys) for keys in rule]
        out.append(f"| `{status}` | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ checking

_JSON_TYPES = {"object": "an object", "array": "a list", "string": "a string",
               "integer": "an integer", "number": "a number", "boolean": "a boolean",
               "null": "null"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is(value: Any, name: str) -> bool:
    got = _json_type(value)
    return got == name or (name == "number" and got == "integer")


def _kind(value: Any) -> str:
    return _JSON_TYPES.get(_json_type(value), _json_type(value))


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


class _Checker:
    """The part of JSON Schema that :func:`json_schema` uses: type, enum, const, properties,
    required, additionalProperties, items, anyOf, allOf, if/then, not, local $ref. ``open``:
    unknown keys allowed and nothing required (the unversioned layout)."""

    def __init__(self, schema: Mapping[str, Any], open_: bool = False):
        self.root, self.open = schema, open_

    def resolve(self, schema: Mapping[str, Any]) -> Mapping[str, Any]:
        while "$ref" in schema:
            ref = schema["$ref"]
            if not ref.startswith("#/$defs/"):
                raise ValueError(f"unsupported $ref {ref}")
            schema = self.root["$defs"][ref[len("#/$defs/"):]]
        return schema

    def errors(self, value: Any, schema: Mapping[str, Any], at: str) -> list[str]:
        schema = self.resolve(schema)
        where = at or "the record"
        if "type" in schema:
            names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if not any(_is(value, n) for n in names):
                want = " or ".join(_JSON_TYPES.get(str(n), str(n)) for n in names)
                return [f"{where}: expected {want}, got {_kind(value)} ({_shown(value)})"]
        if "const" in schema and value != schema["const"]:
            return [f"{where}: expected {_shown(schema['const'])}, got {_shown(value)}"]
        if "enum" in schema and value not in schema["enum"]:
            return [f"{where}: {_shown(value)} is not one of "
                    + ", ".join(_shown(v) for v in schema["enum"])]
        if "not" in schema and not self.errors(value, schema["not"], at):
            return [f"{where}: must not be {_shown(value)}"]
        if "anyOf" in schema:
            tried = [self.errors(value, s, at) for s in schema["anyOf"]]
            if all(tried):
                kinds = [self.resolve(s).get("type") for s in schema["anyOf"]]
                fits = [t for t, kind in zip(tried, kinds)
                        if isinstance(kind, str) and _is(value, kind)]
                if len(fits) == 1:  # the branch of the value's type: what is wrong inside
                    return fits[0]
                want = " or ".join(_JSON_TYPES.get(str(k), str(k)) for k in kinds)
                return [f"{where}: expected {want}, got {_kind(value)} ({_shown(value)})"]
        out: list[str] = []
        if isinstance(value, dict):
            props = schema.get("properties", {})
            if not self.open:
                out += [f"{where}: no key {k!r}" for k in schema.get("required", [])
                        if k not in value]
            for k, v in value.items():
                sub = f"{at}.{k}" if at else str(k)
                if k in props:
                    out += self.errors(v, props[k], sub)
                elif "additionalProperties" in schema:
                    extra = schema["additionalProperties"]
                    if extra is False:
                        if not self.open:
                            out.append(f"{where}: unknown key {k!r}")
                    elif isinstance(extra, Mapping):
                        out += self.errors(v, extra, sub)
        if isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                out += self.errors(item, schema["items"], f"{at}[{i}]")
        for sub_schema in schema.get("allOf", []):
            out += self.errors(value, sub_schema, at)
        if ("if" in schema and not self.open
                and not _Checker(self.root).errors(value, schema["if"], at)):
            out += self.errors(value, schema.get("then", {}), at)
        return out


def check(record: Any, schema: Mapping[str, Any] | None = None, *,
          open_: bool = False) -> list[str]:
    """Every way ``record`` differs from the schema (the shipped one, or ``schema``), each
    naming the key (``memory.peak_bytes: expected an integer, got a string ("lots")``); empty
    when it conforms. ``open_``: allow unknown keys and missing ones (only the types of the
    keys defined here are checked)."""
    schema = schema or shipped_schema()
    return _Checker(schema, open_).errors(record, schema, "")


def _from_v0(record: dict[str, Any]) -> dict[str, Any]:
    """The unversioned layout is version 1's without ``schema_version``."""
    return {"schema_version": 1, **record}


UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {0: _from_v0}
"""``version -> function``: a record of that version in the layout of the next one."""


class Unreadable(ValueError):
    """A record that is not a summary this memlab can read: the message says why."""


def read(record: Any) -> dict[str, Any]:
    """``record`` (a parsed summary.json of any version) checked and in today's layout; raises
    :class:`Unreadable` naming every problem, or the version this memlab cannot read.

    Version 0 (no ``schema_version``: written before the typed record) is checked leniently:
    the keys defined here must have their types (``"memory": "lots"`` is refused), while keys
    no longer written and keys it lacked are let be (its writers changed over time)."""
    if not isinstance(record, dict):
        raise Unreadable(f"the top level is {_kind(record)}, not an object")
    version = record.get("schema_version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise Unreadable(f"schema_version {_shown(version)} is not a version (an integer)")
    if version > SCHEMA_VERSION:
        raise Unreadable(f"schema_version {version} is newer than this memlab reads "
                         f"(up to {SCHEMA_VERSION}): read it with a newer memlab")
    if version == 0:  # checked as it was written, then upgraded
        problems = check({**record, "schema_version": SCHEMA_VERSION}, open_=True)
        _raise(problems)
        return _upgrade(record, version)
    record = _upgrade(record, version)  # upgraded, then checked as today's
    _raise(check(record))
    return record


def _upgrade(record: dict[str, Any], version: int) -> dict[str, Any]:
    for v in range(version, SCHEMA_VERSION):
        record = UPGRADES[v](record)
    return record


def _raise(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise Unreadable("; ".join(problems[:5]) + more)
