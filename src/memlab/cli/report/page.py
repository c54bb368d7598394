"""``memlab report --html``: one self-contained page (the plots embedded) with the fixed
parameters, the table, the notes, the plots and the full reason of every job that is not ok:
what a researcher attaches to a write-up.

The page fits a 1,280 px window (checked in a real browser, ``tests/unit/cli/test_report_page.py``):
the table scrolls sideways inside its own box (every column reachable, none hidden) with the job
column pinned at its left, long reasons wrap, and the plots shrink to the page's width.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from memlab.cli.report.table import NUMERIC_COLUMNS
from memlab.cli.report.text import fixed_line, format_cell, notes

if TYPE_CHECKING:
    import pandas as pd

_STYLE = """
* { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
p, li { overflow-wrap: anywhere; }
.table-box { overflow-x: auto; max-width: 100%; border: 1px solid #e4e4e4; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: left;
         white-space: nowrap; background: #fff; }
th { background: #f4f4f4; }
th:first-child, td:first-child { position: sticky; left: 0; z-index: 1;
                                 border-right: 1px solid #ddd; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.error { white-space: normal; min-width: 16em; max-width: 36em; overflow-wrap: anywhere; }
tr.front td { background: #fdf0f0; }
tr.notok td { color: #a00000; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.plots img { flex: 1 1 540px; max-width: 100%; height: auto; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 0.8em; white-space: pre-wrap; overflow-wrap: anywhere; }
"""


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _klass(column: str) -> str:
    return "num" if column in NUMERIC_COLUMNS else ("error" if column == "error" else "")


def format_html(df: pd.DataFrame, images: Sequence[Path] = (), title: str = "memlab report",
                ) -> str:
    """The whole page as a string (``images``: PNGs to embed)."""
    esc = html.escape
    cols = [str(c) for c in df.columns if c != "error"] + ["error"]
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    rows = []
    for rec in df[cols].itertuples(index=False):
        cells = dict(zip(cols, rec))
        klass = "front" if cells.get("pareto") else ("notok" if cells["status"] != "ok" else "")
        tds = "".join(f'<td class="{_klass(c)}">{esc(format_cell(c, v))}</td>'
                      for c, v in cells.items())
        rows.append(f'<tr class="{klass}">{tds}</tr>')
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
