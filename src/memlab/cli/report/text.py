"""``memlab report``, the table as text: aligned plain text for the console, Markdown for
``report.md`` (with the plots and every failed job's full reason), and the cell formatting the
HTML page shares."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memlab.cli.report.table import (
    ASSUMED_SPREAD,
    CATEGORIES,
    DELTA_COLUMNS,
    ENGINE_COLUMN,
    FLOAT_COLUMNS,
    NUMERIC_COLUMNS,
    PHASES,
)
from memlab.measure.console import markdown_code, markdown_fence, markdown_text, printable

if TYPE_CHECKING:
    import pandas as pd

_FORMATS = {
    **{col: "{:.1f}" for col in (*FLOAT_COLUMNS, ENGINE_COLUMN)},
    "timed_steps": "{:.0f}",
    "padding_frac": "{:.3f}",
    "final_loss": "{:.4f}",
    "eval_loss": "{:.4f}",
    "eval_reward": "{:.4f}",
    **{col: "{:+.1f}" for col in DELTA_COLUMNS},
    "d_peak_pct": "{:+.1f}%",
    "d_tokens_per_s_pct": "{:+.1f}%",
}
_HIDDEN_IN_TEXT = ("run_dir", *(col for _, col in PHASES),
                   *(f"d_{col}" for _, col in CATEGORIES))


def format_cell(column: str, value: Any) -> str:
    """Text of one table cell: fixed decimals for metrics, ``-`` for blanks, ``yes`` on the front."""
    if column == "pareto":
        return "yes" if bool(value) else ""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "" if column == "error" else "-"
    if column == "timed_steps" and isinstance(value, (int, float)) and value < 2:
        return f"{value:.0f}!"  # a single timed step: no spread measured (see the notes)
    fmt = _FORMATS.get(column)
    if fmt is not None and isinstance(value, (int, float)):
        return fmt.format(value)
    return printable(str(value).replace("\n", " "))  # a file name, a tag, an error: shown, not obeyed


def _text_rows(df: pd.DataFrame) -> tuple[list[str], list[list[str]], list[bool]]:
    """Visible columns (``error`` last), formatted cells, and which columns are numeric."""
    cols = [str(c) for c in df.columns if c not in _HIDDEN_IN_TEXT and c != "error"]
    cols.append("error")  # the widest column goes last so the numbers stay readable
    rows = [[format_cell(c, v) for c, v in zip(cols, rec)] for rec in df[cols].itertuples(False)]
    base = baseline_job(df)
    for r in rows:
        if base is not None and r[0] == base:
            r[0] += " (baseline)"
    numeric = [c in NUMERIC_COLUMNS for c in cols]
    return cols, rows, numeric


def baseline_job(df: pd.DataFrame) -> str | None:
    """The job ``--baseline`` named (its row is marked), or None."""
    base = df.attrs.get("baseline")
    return None if not base else str(base["job"])


def fixed_line(df: pd.DataFrame) -> str:
    """``fixed: key=value, ...`` for the parameters shared by all jobs."""
    fixed = df.attrs.get("fixed") or {}
    return "fixed: " + printable(", ".join(f"{k}={v}" for k, v in fixed.items()) or "(none)")


def notes(df: pd.DataFrame) -> list[str]:
    """What a reader must know to trust the front: how throughput spread was judged."""
    out = ["pareto: less memory and measurably more tokens/s (apart by more than the larger "
           "spread, tps_spread = std of the timed steps' tokens/s)"]
    unmeasured = df.attrs.get("unmeasured") or []
    if unmeasured:
        out.append(f"! no measured spread for job(s) {', '.join(unmeasured)} (fewer than 2 timed "
                   f"steps, or no throughput.tokens_per_s_std): assumed "
                   f"{df.attrs.get('assumed_spread', ASSUMED_SPREAD):.0%} of their tokens/s; "
                   "raise train.steps to time more steps")
    return out + list((df.attrs.get("baseline") or {}).get("notes") or [])


def format_text(df: pd.DataFrame) -> str:
    """The table as plain aligned text, preceded by the ``fixed:`` line and followed by notes."""
    cols, rows, numeric = _text_rows(df)
    widths = [max([len(c)] + [len(r[j]) for r in rows]) for j, c in enumerate(cols)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(w) if num else cell.ljust(w) for cell, w, num in zip(cells, widths, numeric)
        ]
        return "  ".join(parts).rstrip()

    out = [fixed_line(df), "", line(cols), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows)
    return "\n".join([*out, "", *notes(df)])


def _md_escape(text: str) -> str:
    return markdown_text(text.replace("\n", " "))


def format_markdown(df: pd.DataFrame, images: Sequence[str] = ()) -> str:
    """The report as markdown: ``fixed:`` line, table, notes, the plots (``images``: file names
    beside the report) and the full reason of every failed job."""
    cols, rows, numeric = _text_rows(df)
    out = ["# memlab report", "", markdown_text(fixed_line(df)), ""]
    out.append("| " + " | ".join(_md_escape(c) for c in cols) + " |")
    out.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
    out.extend("| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows)
    out += ["", *(f"{markdown_text(n)}  " for n in notes(df))]
    if images:
        out += ["", *(f"![{name}]({name})" for name in images)]
    failures = df.attrs.get("failures") or []
    if failures:
        out += ["", "## Jobs that did not end ok", ""]
        for f in failures:
            out.append(f"### job {markdown_text(str(f['job']))}: {markdown_code(f['status'])}")
            out.append("")
            out.append(f"run dir: {markdown_code(str(f['run_dir']))}")
            out.append("")
            error = printable(f["error"].rstrip(), keep_newlines=True) or "(no reason recorded)"
            fence = markdown_fence(error)
            out += [fence + "text", error, fence, ""]
    return "\n".join(out).rstrip() + "\n"
