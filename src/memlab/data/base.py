"""What a data source provides (:class:`DataSource`), and the helpers the sources share: row
validation with row/field names, limits."""

from __future__ import annotations

from typing import Any, Protocol


class DataSource(Protocol):
    """A ``data=`` option: where the raw rows come from (``load`` returns a
    ``datasets.Dataset`` of raw rows: conversations, text, prompt/completion or preference
    pairs; the method's ``prepare`` tokenizes them)."""

    def validate(self, ctx) -> list[str]: ...

    def load(self, ctx) -> Any: ...


class DataError(ValueError):
    """A malformed dataset row; the message names the row index and the field."""


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
