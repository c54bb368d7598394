"""``memlab report --html``: one self-contained page (the plots embedded) with the fixed
parameters, the table, the notes, the plots side by side and the full reason of every job that
is not ok: what a researcher attaches to a write-up."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from memlab.cli.report.table import ENGINE_COLUMN, FLOAT_COLUMNS, fixed_line, format_cell, notes

if TYPE_CHECKING:
    import pandas as pd

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.front td { background: #fdf0f0; }
tr.notok td { color: #a00000; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.plots img { max-width: 48%; min-width: 420px; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 0.8em; white-space: pre-wrap; }
"""


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def format_html(df: pd.DataFrame, images: Sequence[Path] = (), title: str = "memlab report",
                ) -> str:
    """The whole page as a string (``images``: PNGs to embed, shown side by side)."""
    esc = html.escape
    cols = [str(c) for c in df.columns if c != "error"] + ["error"]
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    rows = []
    for rec in df[cols].itertuples(index=False):
        cells = dict(zip(cols, rec))
        klass = "front" if cells.get("pareto") else ("notok" if cells["status"] != "ok" else "")
        tds = "".join(
            f'<td class="{"num" if c in FLOAT_COLUMNS or c == ENGINE_COLUMN else ""}">{esc(format_cell(c, v))}</td>'
            for c, v in cells.items())
        rows.append(f'<tr class="{klass}">{tds}</tr>')
    parts = [
        "<!doctype html>", '<html><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>", f"<p>{esc(fixed_line(df))}</p>",
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>",
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
