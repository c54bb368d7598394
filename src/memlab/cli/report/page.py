"""``memlab report --html``: one self-contained page (the plots embedded) with the fixed
parameters, the table, the notes, the plots and the full reason of every job that is not ok:
what a researcher attaches to a write-up.

The page fits a 1,280 px window (checked in a real browser, ``tests/unit/cli/test_report_page.py``):
a sweep of a few settings, with a baseline, shows every column without scrolling sideways:
column names break after ``_`` and ``.``, text (settings, reasons, run dirs) wraps, numbers do
not, and each ``d_*`` change against the baseline stands under the value it changes, in the same
cell (its name under the column's). The baseline's row is marked. A wider table still scrolls
sideways inside its own box (every column reachable, none hidden) with the job column pinned at
its left; the plots shrink to the page's width.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from memlab.cli.report.table import DELTA_COLUMNS, NUMERIC_COLUMNS
from memlab.cli.report.text import baseline_job, fixed_line, format_cell, notes

if TYPE_CHECKING:
    import pandas as pd

_STYLE = """
* { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
p, li { overflow-wrap: anywhere; }
.table-box { overflow-x: auto; max-width: 100%; border: 1px solid #e4e4e4; }
table { border-collapse: collapse; font-size: 11px; }
th, td { border-bottom: 1px solid #ddd; padding: 2px 4px; text-align: left;
         vertical-align: top; background: #fff; overflow-wrap: break-word; }
th { background: #f4f4f4; font-weight: 600; overflow-wrap: anywhere; }
th:first-child, td:first-child { position: sticky; left: 0; z-index: 1;
                                 border-right: 1px solid #ddd; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap;
         overflow-wrap: normal; }
td.error { white-space: normal; overflow-wrap: anywhere; }
tr.reason td { border-top: 0; padding-bottom: 4px; }
.d { display: block; font-size: 11px; color: #555; font-weight: normal; }
td .d.less { color: #17692c; }
td .d.more { color: #a04000; }
tr.front td { background: #fdf0f0; }
tr.notok td { color: #a00000; }
tr.baseline td { background: #eef3fb; font-weight: 600; }
tr.baseline td:first-child { box-shadow: inset 3px 0 #3563b3; }
.mark { display: block; font-size: 9px; color: #3563b3; font-weight: 600; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.plots img { flex: 1 1 540px; max-width: 100%; height: auto; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 0.8em; white-space: pre-wrap; overflow-wrap: anywhere; }
"""


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _klass(column: str) -> str:
    return "num" if column in NUMERIC_COLUMNS else ("error" if column == "error" else "")


def _name(text: str) -> str:
    """``text`` (a column's name, a setting, a path) escaped, breakable after each ``_ . / - =
    ,`` (a long one wraps there, never cut; a word stays whole)."""
    return re.sub(r"([_./=,-])", r"\1<wbr>", html.escape(text, quote=False))


def _under(columns: Sequence[str]) -> dict[str, list[str]]:
    """The ``d_*`` columns of a baseline under the column each changes (``peak_MiB`` ->
    ``d_peak_MiB``, ``d_peak_pct``; ``tokens_per_s`` -> ``d_tokens_per_s_pct``)."""
    out: dict[str, list[str]] = {}
    for d in DELTA_COLUMNS:
        if d in columns:
            base = {"d_peak_pct": "peak_MiB", "d_tokens_per_s_pct": "tokens_per_s"}.get(d, d[2:])
            out.setdefault(base, []).append(d)
    return out


def _delta(column: str, value: object) -> str:
    text = format_cell(column, value)
    if text == "-":  # no change computed (a job, or the baseline, not ok)
        return ""
    sign = "less" if text.startswith("-") and text != "-" else (
        "more" if text.startswith("+") and text.strip("+0.%") else "")
    # a saving (less memory) reads green; for tokens/s more is the better way
    if column == "d_tokens_per_s_pct":
        sign = {"less": "more", "more": "less"}.get(sign, "")
    return f'<span class="d {sign}" title="{column}">{html.escape(text)}</span>'


def format_html(df: pd.DataFrame, images: Sequence[Path] = (), title: str = "memlab report",
                ) -> str:
    """The whole page as a string (``images``: PNGs to embed)."""
    esc = html.escape
    under = _under([str(c) for c in df.columns])
    stacked = {d for ds in under.values() for d in ds}
    every = [str(c) for c in df.columns]
    cols = [c for c in every if c not in stacked and c != "error"]
    head = "".join(f'<th data-col="{esc(c)}">{_name(c)}'
                   + "".join(f'<span class="d" data-col="{d}">{_name(d)}</span>'
                             for d in under.get(c, ()))
                   + "</th>" for c in cols)
    base = baseline_job(df)
    rows = []
    for rec in df[every].itertuples(index=False):
        cells = dict(zip(every, rec))
        marked = base is not None and str(cells["job"]) == base
        klass = "baseline" if marked else "front" if cells.get("pareto") else (
            "notok" if cells["status"] != "ok" else "")
        tds = []
        for c in cols:
            shown = format_cell(c, cells[c])
            text = (esc(shown) if c in NUMERIC_COLUMNS else _name(shown)) + (
                '<span class="mark">baseline</span>' if marked and c == "job" else "")
            text += "".join(_delta(d, cells[d]) for d in under.get(c, ()))
            tds.append(f'<td class="{_klass(c)}">{text}</td>')
        rows.append(f'<tr class="{klass}">{"".join(tds)}</tr>')
        reason = format_cell("error", cells.get("error"))
        if reason:  # prose: a row of its own under the job's, the table's whole width
            rows.append(f'<tr class="{klass} reason"><td></td><td class="error" '
                        f'colspan="{len(cols) - 1}" data-col="error"><b>error</b> '
                        f"{esc(reason)}</td></tr>")
    parts = [
        "<!doctype html>", '<html><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>", f"<p>{esc(fixed_line(df))}</p>",
        '<div class="table-box">'
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>",
        "<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes(df)) + "</ul>",
    ]
    if images:
        parts.append('<div class="plots">' + "".join(_img(p) for p in images) + "</div>")
    failures = df.attrs.get("failures") or []
    if failures:
        parts.append("<h2>Jobs that are not ok</h2>")
        for f in failures:
            parts.append(f"<h3>job {esc(str(f['job']))}: {esc(f['status'])}</h3>"
                         f"<p>run dir: <code>{esc(f['run_dir'])}</code></p>"
                         f"<pre>{esc(f['error'].rstrip() or '(no reason recorded)')}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
