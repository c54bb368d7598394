"""Text from a run's inputs (file names, W&B tags, errors quoting data, run dirs), made safe for
where memlab writes it: a terminal, a Markdown page, a spreadsheet.

- :func:`printable`: control characters (C0, DEL, C1) and the bidirectional overrides shown as
  escapes (``\\x1b``, ``\\u202e``), so a name cannot set the terminal's title, clear the screen
  or reorder what is printed after it;
- :func:`markdown_text`, :func:`markdown_code`, :func:`markdown_fence`: text that renders as
  itself in Markdown (HTML escaped as entities, Markdown's own punctuation escaped; a code span
  or fence longer than any run of backticks inside it);
- :func:`csv_cell`: a cell a spreadsheet would read as a formula (``=``, ``+``, ``-``, ``@``, a
  tab or a carriage return first) gets a leading ``'``.
"""

from __future__ import annotations

import re
from typing import Any

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_MARKDOWN = re.compile(r"([\\`*\[\]|!])")
_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: str, keep_newlines: bool = False) -> str:
    """``text`` with every control character shown as an escape (``keep_newlines``: line
    breaks stay, for a block of several lines)."""
    if keep_newlines:
        return "\n".join(_CONTROL.sub(_escape, line) for line in text.split("\n"))
    return _CONTROL.sub(_escape, text)


def markdown_text(text: str) -> str:
    """``text`` as Markdown that renders as the text itself, on one line (a table cell, a
    paragraph): HTML as entities, Markdown's punctuation escaped, control characters shown."""
    text = printable(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MARKDOWN.sub(r"\\\1", text)


def _longest_backticks(text: str) -> int:
    return max((len(m) for m in re.findall("`+", text)), default=0)


def markdown_code(text: str) -> str:
    """``text`` as an inline code span that no backtick inside it can close."""
    text = printable(text)
    ticks = "`" * (_longest_backticks(text) + 1)
    return f"{ticks} {text} {ticks}" if "`" in text else f"`{text}`"


def markdown_fence(text: str) -> str:
    """The fence (at least three backticks) of a code block that ``text`` cannot close."""
    return "`" * max(3, _longest_backticks(text) + 1)


def csv_cell(value: Any) -> Any:
    """``value`` as a CSV cell no spreadsheet evaluates: a string that would start a formula
    gets a leading ``'``; numbers and other values are kept."""
    if isinstance(value, str):
        value = printable(value)
        if value.startswith(_FORMULA):
            return "'" + value
    return value
