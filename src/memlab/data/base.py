"""Shared helpers of the data sources: the source protocol, row validation with row/field
names, limits."""

from __future__ import annotations

import re
from typing import Any, Protocol


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


class DataSource(Protocol):
    """What every ``data=`` option provides."""

    name: str

    def validate(self, ctx) -> list[str]:
        """Problems found before anything is read (each names its fix)."""
        ...

    def load(self, ctx) -> Any:
        """The rows, as a ``datasets.Dataset``."""
        ...

    def locate(self, ds: Any, row: int) -> str:
        """Where row ``row`` of ``ds`` (what :meth:`load` returned) comes from, in words: a
        file and line, a hub dataset's row."""
        ...


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
    """Raise DataError unless ``messages`` is a list of {role, content} dicts."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"row {row}: field '{field}' must be a non-empty list of messages, "
                        f"got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"row {row}: field '{field}'[{i}] must be a dict with 'role' and "
                            f"'content', got {type(m).__name__}")
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise DataError(f"row {row}: field '{field}'[{i}].role must be system/user/assistant/"
                            f"tool, got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"row {row}: field '{field}'[{i}].content must be a string, got "
                            f"{type(m.get('content')).__name__}")


def check_text(value: Any, row: int, field: str) -> None:
    if not isinstance(value, str):
        raise DataError(f"row {row}: field '{field}' must be a string, got "
                        f"{type(value).__name__}")
