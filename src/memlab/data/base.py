"""Shared helpers of the data sources: the source protocol (:class:`DataSource` and
:class:`SplitSource`, in :mod:`memlab.protocols` and re-exported here), row validation (and
normalization, :func:`normalize_messages`) with row/field names, limits."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from memlab import registry
from memlab.protocols import DataSource
from memlab.protocols import SplitSource as SplitSource


class DataError(ValueError):
    """A malformed dataset (status ``invalid``): the message names the file and line, or the row,
    and the field. ``row``: the row of the loaded dataset it is about (None: not one row); a
    message that starts with ``row N:`` (the convention of every row check) says it."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message)
        if row is None:
            m = re.match(r"row (\d+):", message)
            row = int(m.group(1)) if m else None
        self.row = row


DataSourceClass = TypeVar("DataSourceClass", bound=DataSource)


def register(name: str) -> Callable[[type[DataSourceClass]], type[DataSourceClass]]:
    """Register a ``data=`` option (mypy checks it against :class:`DataSource`)."""
    return registry.register("data", name)


def build_source(node: Mapping[str, Any], where: str) -> tuple[DataSource | None, list[str]]:
    """The ``data=`` option a config node describes (a mixture's source), built and checked as
    the run's own is (:func:`memlab.registry.build`)."""
    obj, errors = registry.build("data", node, where=where)
    # the data group holds only the classes its typed register admitted: DataSources
    return cast("DataSource | None", obj), errors


def original_row(ds: Any, row: int) -> int:
    """The index, in the source as read, of row ``row`` of ``ds`` after :func:`limit` (datasets
    keeps a selection or a shuffle as an indices mapping over the rows read)."""
    mapping = getattr(ds, "_indices", None)
    if mapping is None:
        return row
    return int(mapping.column(0)[row].as_py())


def limit(ds, max_examples: int | None, seed: int | None = None):
    """First ``max_examples`` rows (or a seeded sample when ``seed`` is given)."""
    if max_examples is None or max_examples >= len(ds):
        return ds
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    return ds.select(range(max_examples))


def check_messages(messages: Any, row: int, field: str) -> None:
    """Raise DataError unless ``messages`` is a list of {role, content} dicts; normalize them in
    place first (:func:`normalize_messages`: ShareGPT's from / value,
    content given as a list of text parts, the empty keys columnar storage adds). ``content``
    may be null only in an assistant turn that carries ``tool_calls``."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"row {row}: field '{field}' must be a non-empty list of messages, "
                        f"got {type(messages).__name__}")
    normalize_messages(messages, row, field)
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise DataError(f"row {row}: field '{field}'[{i}].role must be system/user/assistant/"
                            f"tool, got {m.get('role')!r}")
        content = m.get("content")
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise DataError(f"row {row}: field '{field}'[{i}].content must be a string (or null "
                            "in an assistant turn with tool_calls), got "
                            f"{type(content).__name__}")


def check_text(value: Any, row: int, field: str) -> None:
    if not isinstance(value, str):
        raise DataError(f"row {row}: field '{field}' must be a string, got "
                        f"{type(value).__name__}")


SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "model": "assistant", "bot": "assistant", "chatgpt": "assistant", "system": "system",
    "tool": "tool", "observation": "tool", "function_response": "tool",
}
"""ShareGPT ``from`` values -> roles (case-insensitive)."""


def normalize_messages(messages: list, row: int, field: str) -> None:
    """Normalize a conversational field in place (module docstring); DataError naming the row,
    field and message for what cannot be read."""
    for i, m in enumerate(messages):
        where = f"row {row}: field '{field}'[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where} must be a dict with 'role' and 'content', got "
                            f"{type(m).__name__}")
        for key in [k for k, v in m.items() if v is None and k != "content"]:
            del m[key]
        if "role" not in m and "from" in m:  # ShareGPT
            role = SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise DataError(f"{where}.from must be one of {', '.join(SHAREGPT_ROLES)} "
                                f"(a ShareGPT turn), got {m['from']!r}")
            m["role"] = role
            m["content"] = m.pop("value", None)
            del m["from"]
        if isinstance(m.get("content"), list):
            m["content"] = _text_of_parts(m["content"], where)
        if "tool_calls" in m:
            m["tool_calls"] = _strip_nulls(m["tool_calls"])
        if "content" not in m:
            m["content"] = None


def _text_of_parts(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise DataError(f"{where}.content[{j}] is a {kind or type(part).__name__!r} part; "
                            "memlab trains on text: give content as a string or a list of "
                            "{type: text, text: ...} parts")
        texts.append(part["text"])
    return "".join(texts)


def normalize_tools(tools: Any, row: int) -> list | None:
    """A row's ``tools`` as the template takes them: a list of JSON schemas (parsed from a JSON
    string, nulls dropped), or None when the row has none."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"row {row}: field 'tools' is a string but not JSON ({e.msg} at "
                            f"column {e.colno}); give a list of tool schemas") from e
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"row {row}: field 'tools' must be a list of tool schemas (dicts), got "
                        f"{type(tools).__name__}")
    return _strip_nulls(tools)


def _strip_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value
