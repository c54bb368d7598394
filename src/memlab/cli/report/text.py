"""``memlab report``, the table as text: aligned plain text for the console, Markdown for
``report.md`` (with the plots and every failed job's full reason), and the cell formatting the
HTML page shares."""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping, Sequence
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
from memlab.measure.speed import MIN_TIMED, NOT_TIMED

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
    if column == "timed_steps" and isinstance(value, (int, float)) and value < MIN_TIMED:
        return f"{value:.0f}!"  # too few timed steps to rank its tokens/s (see the notes)
    fmt = _FORMATS.get(column)
    if fmt is not None and isinstance(value, (int, float)):
        return fmt.format(value)
    return printable(str(value).replace("\n", " "))  # a file name, a tag, an error: shown, not obeyed


def speed_cells(df: pd.DataFrame, row: Mapping[str, Any]) -> dict[str, str]:
    """The cells of ``row`` (a job's values by column) that show no ranked speed: a job whose
    tokens/s is not timed (``untimed``) reads ``not timed`` on the front (``pareto``) and its
    tokens/s is marked (``!``: shown, not ranked); a tokens/s change against a baseline where
    either job is not timed reads ``not timed``."""
    job = str(row["job"])
    out = {}
    if job in {str(j) for j in df.attrs.get("untimed") or []}:
        out["pareto"] = NOT_TIMED
        tps = row.get("tokens_per_s")
        if isinstance(tps, (int, float)) and math.isfinite(tps):
            out["tokens_per_s"] = format_cell("tokens_per_s", tps) + "!"
    if job in ((df.attrs.get("baseline") or {}).get("untimed") or []):
        out["d_tokens_per_s_pct"] = NOT_TIMED
    return out


def _text_rows(df: pd.DataFrame, every: bool = False,
               ) -> tuple[list[str], list[list[str]], list[bool]]:
    """Visible columns (``error`` last; ``every``: the :data:`_HIDDEN_IN_TEXT` ones too),
    formatted cells (:func:`speed_cells` where a speed is not ranked), and which columns are
    numeric."""
    hidden = () if every else _HIDDEN_IN_TEXT
    cols = [str(c) for c in df.columns if c not in hidden and c != "error"]
    cols.append("error")  # the widest column goes last so the numbers stay readable
    every_col = [str(c) for c in df.columns]
    rows = []
    for rec in df[every_col].itertuples(False):
        cells = dict(zip(every_col, rec))
        marks = speed_cells(df, cells)
        rows.append([marks.get(c) or format_cell(c, cells[c]) for c in cols])
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


def fastest_line(df: pd.DataFrame) -> str | None:
    """``fastest: job 0 (1000.0 tokens/s)``, with the jobs tied with it within the larger of
    the two spreads (the measurement does not order them); None when no job is timed."""
    top = df.attrs.get("fastest")
    if not top:
        return None
    line = f"fastest: job {top['job']} ({top['tokens_per_s']:.1f} tokens/s)"
    if top["tied"]:
        line += (f", tied with job(s) {', '.join(top['tied'])} (within the larger of the two "
                 "spreads: not ranked apart)")
    return line


def notes(df: pd.DataFrame) -> list[str]:
    """What a reader must know to trust the front: how throughput spread was judged, which
    jobs are not timed, and the fastest."""
    out = ["pareto: less memory and measurably more tokens/s (apart by more than the larger "
           f"spread, tps_spread = std of the timed steps' tokens/s), from jobs timed on at least "
           f"{MIN_TIMED} steps"]
    fastest = fastest_line(df)
    if fastest:
        out.append(fastest)
    untimed = df.attrs.get("untimed") or []
    if untimed:
        out.append(f"! {NOT_TIMED}: job(s) {', '.join(untimed)} (fewer than {MIN_TIMED} timed "
                   "steps: timed_steps N!): tokens/s shown (marked !), not ranked: not the "
                   "fastest, not on the front, no change against a baseline; raise train.steps")
    unmeasured = df.attrs.get("unmeasured") or []
    if unmeasured:
        out.append(f"! no measured spread for job(s) {', '.join(unmeasured)} (no "
                   f"throughput.tokens_per_s_std in the summary): assumed "
                   f"{df.attrs.get('assumed_spread', ASSUMED_SPREAD):.0%} of their tokens/s")
    return out + list((df.attrs.get("baseline") or {}).get("notes") or [])


WIDTH = 120
"""The console table's width by default (``memlab report --wide``: every column, however wide)."""
_GROUPS = {"MiB by phase": tuple(col for _, col in PHASES),
           "MiB by category": (*(col for _, col in CATEGORIES), ENGINE_COLUMN),
           "d_*_MiB": ("d_peak_MiB", *(f"d_{col}" for _, col in CATEGORIES))}
"""Columns the line under a narrowed table names together."""
_ELSEWHERE: tuple[tuple[str, ...], ...] = (
    _GROUPS["MiB by category"],  # the category plot and the page show them
    ("d_peak_MiB",),  # d_peak_pct stays
)
_DETAIL: tuple[tuple[str, ...], ...] = (
    ("padding_frac",),
    ("tps_spread", "timed_steps"),  # a job timed on one step stays named in the notes
)
"""The columns the console leaves out, group by group in this order, until its table fits: first
what is shown elsewhere (:data:`_ELSEWHERE`), then, once names are short, these details (the job,
what varies, status, peak, tokens/s, losses, the front and the changes always stay). The
:data:`_HIDDEN_IN_TEXT` columns (run dir, memory by phase, the changes by category) it leaves
out first, always."""
_LONGEST_VALUE = 24
"""A setting's value longer than this is cut in the middle (``...``) once the table is too wide."""


def _pieces(name: str) -> list[str]:
    """``train.gradient_checkpointing`` -> ``train.``, ``gradient_``, ``checkpointing``."""
    return re.findall(r"[^._]*[._]|[^._]+$", name) or [name]


def _break(name: str, width: int) -> list[str]:
    """``name`` over lines of at most ``width`` characters, broken only after ``.`` and ``_``
    (a piece longer than ``width`` stays whole)."""
    lines = [""]
    for piece in _pieces(name):
        if lines[-1] and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return lines


def _two_lines(name: str, least: int) -> int:
    """The narrowest width, at least ``least``, that puts ``name`` on two lines (or fewer)."""
    width = max(least, max(len(p) for p in _pieces(name)))
    while len(_break(name, width)) > 2:
        width += 1
    return width


def _cut(text: str, most: int = _LONGEST_VALUE) -> str:
    """``text`` cut in the middle to ``most`` characters (its start and its end both stay)."""
    if len(text) <= most:
        return text
    head = (most - 3) // 2
    return text[:head] + "..." + text[len(text) - (most - 3 - head):]


class _Table:
    """The console table as columns (a name over one or more lines) and rows of cells."""

    def __init__(self, df: pd.DataFrame) -> None:
        self.cols, self.rows, numeric = _text_rows(df, every=True)
        self.numeric = dict(zip(self.cols, numeric))
        self.heads = {c: [c] for c in self.cols}
        self.reasons: list[str] = []  # each job's reason, when it goes on the line under its row
        self.wrap = WIDTH  # the width those lines wrap at

    def values(self, col: str) -> list[str]:
        j = self.cols.index(col)
        return [r[j] for r in self.rows]

    def width_of(self, col: str) -> int:
        return max([len(h) for h in self.heads[col]] + [len(v) for v in self.values(col)])

    def width(self, cols: Sequence[str] | None = None) -> int:
        cols = self.cols if cols is None else cols
        return sum(self.width_of(c) for c in cols) + 2 * (len(cols) - 1)

    def drop(self, col: str) -> list[str]:
        j = self.cols.index(col)
        del self.cols[j]
        return [r.pop(j) for r in self.rows]

    def lines(self, cols: Sequence[str]) -> list[str]:
        widths = [self.width_of(c) for c in cols]
        depth = max(len(self.heads[c]) for c in cols)
        index = [self.cols.index(c) for c in cols]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(cell.rjust(w) if self.numeric[c] else cell.ljust(w)
                             for cell, w, c in zip(cells, widths, cols)).rstrip()

        out = [line([(self.heads[c] + [""] * depth)[k] for c in cols]) for k in range(depth)]
        out.append("  ".join("-" * w for w in widths))
        for i, r in enumerate(self.rows):
            out.append(line([r[j] for j in index]))
            if self.reasons and self.reasons[i] and "status" in cols:
                out.extend(textwrap.wrap(self.reasons[i], self.wrap, initial_indent="    error: ",
                                         subsequent_indent=" " * 11, break_on_hyphens=False))
        return out


def _narrow(table: _Table, settings: Sequence[str], width: int) -> tuple[list[str], list[str]]:
    """Narrow ``table`` to ``width`` characters, one step at a time and only while it is wider:
    1. each job's reason goes on the line under its row (the widest column; nothing is lost);
    2. the :data:`_ELSEWHERE` columns are left out: memory by category (the category plot and the
       page show it), ``d_peak_MiB`` (``d_peak_pct`` stays);
    3. the settings are named by their last dotted part (where that names one setting), and long
       column names break after ``_`` or ``.`` onto a second line (the name longest past its
       values first);
    4. the :data:`_DETAIL` columns are left out: ``padding_frac``, then ``tps_spread`` and
       ``timed_steps``;
    5. a setting's value over :data:`_LONGEST_VALUE` characters is cut in the middle (``...``);
    6. what is still too wide continues in blocks of columns, each led by the job (:func:`_blocks`).
    Returns the left-out columns and what else was shortened (for the line under the table)."""
    left: list[str] = []
    shortened: list[str] = []
    table.wrap = width

    def leave_out(groups: Sequence[Sequence[str]]) -> None:
        for group in groups:
            if table.width() <= width:
                return
            for col in group:
                if col in table.cols:
                    table.drop(col)
                    left.append(col)

    if table.width() > width and "error" in table.cols:
        table.reasons = table.drop("error")
    leave_out(_ELSEWHERE)
    if table.width() > width:
        tails = [s.rsplit(".", 1)[-1] for s in settings]
        for s, tail in zip(settings, tails):
            if tail != s and tails.count(tail) == 1 and tail not in table.cols:
                table.heads[s] = [tail]
                shortened.append("short setting names")
    excess = sorted(table.cols[1:], key=lambda c: len(table.heads[c][0]) - max(
        (len(v) for v in table.values(c)), default=0), reverse=True)
    broken = []
    for col in excess:
        if table.width() <= width:
            break
        least = max((len(v) for v in table.values(col)), default=1)
        table.heads[col] = _break(table.heads[col][0], _two_lines(table.heads[col][0], least))
        broken.append(col)
    leave_out(_DETAIL)
    for col in reversed(broken):  # a name whose room the details left back goes on one line
        head = table.heads[col]
        table.heads[col] = ["".join(head)]
        if table.width() > width:
            table.heads[col] = head
    if table.width() > width:
        for s in settings:
            j = table.cols.index(s)
            for r in table.rows:
                if len(r[j]) > _LONGEST_VALUE:
                    r[j] = _cut(r[j])
                    shortened.append("long values cut (...)")
    return left, list(dict.fromkeys(shortened))


def _blocks(table: _Table, width: int) -> list[list[str]]:
    """The columns in blocks that each fit ``width`` (every block led by the job column)."""
    blocks = [[table.cols[0]]]
    for col in table.cols[1:]:
        if len(blocks[-1]) > 1 and table.width([*blocks[-1], col]) > width:
            blocks.append([table.cols[0]])
        blocks[-1].append(col)
    return blocks


def _left_out_line(left: Sequence[str], shortened: Sequence[str], blocks: int,
                   width: int) -> str:
    """One line under the narrowed table: the columns it left out, and that ``--wide`` shows
    them (then, where the line has room, what it shortened)."""
    named: list[str] = []
    for col in left:
        group = next((g for g, cols in _GROUPS.items() if col in cols), None)
        together = group is not None and sum(c in _GROUPS[group] for c in left) > 1
        named.append(group if together and group else col)
    line = f"left out (--wide shows them): {', '.join(dict.fromkeys(named))}" if named else (
        "--wide shows the whole table")
    for more in (*shortened, *([f"{blocks} blocks of columns"] if blocks > 1 else [])):
        if len(line) + 2 + len(more) <= width:
            line += f"; {more}"
    return line


def format_text(df: pd.DataFrame, width: int | None = WIDTH) -> str:
    """The table as plain aligned text, preceded by the ``fixed:`` line and followed by notes.

    ``width``: the table fits this many characters (:func:`_narrow` says how; a line under the
    table names what it left out); ``None``: every column, however wide (``--wide``)."""
    table = _Table(df)
    said: list[str] = []
    if width is not None:
        left = []
        for col in _HIDDEN_IN_TEXT:  # never on the console by default
            if col in table.cols and any(v not in ("-", "") for v in table.drop(col)):
                left.append(col)  # (a column with nothing in it goes unnamed)
        shortened: list[str] = []
        if table.width() > width:
            settings = [str(p) for p in df.attrs.get("params") or [] if p in table.cols]
            more, shortened = _narrow(table, settings, width)
            left += more
        blocks = _blocks(table, width)
        if left or shortened or len(blocks) > 1:
            said.append(_left_out_line(left, shortened, len(blocks), width))
    else:
        blocks = [table.cols]
    def fill(lines: Sequence[str]) -> list[str]:  # the lines over and under it wrap at its width
        return list(lines) if width is None else [textwrap.fill(
            line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
            for line in lines]

    out = fill([fixed_line(df)])
    for cols in blocks:
        out += ["", *table.lines(cols)]
    out += [*said, *fill(["", *notes(df)])]
    return "\n".join(out)


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
