"""``memlab report --html``: one self-contained page (the plots embedded) with the fixed
parameters, the table, the notes, the plots and the full reason of every job that is not ok:
what a researcher attaches to a write-up.

The page is rendered from a jinja2 template (``templates/report.html.j2``, autoescape on: every
value read from a summary is escaped, the data the page's script reads too: it is JSON with
``<``, ``>``, ``&`` and ``'`` written as ``\\u003c``...). A small inline script (no CDN, no
request) sorts the table by any column (click its name; a ``d_*`` change under it sorts by the
change) and filters it by any column or all (text it holds, or a comparison: ``>1000``,
``<=2.5``, ``!=ok``); a legend says what the row tints and the change colours mean, and a
glossary what each column holds.

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
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlab.cli.report.table import CATEGORIES, DELTA_COLUMNS, NUMERIC_COLUMNS, PHASES
from memlab.cli.report.text import baseline_job, fixed_line, format_cell, notes, speed_cells
from memlab.measure.console import printable

if TYPE_CHECKING:
    import pandas as pd

TEMPLATE = "report.html.j2"
"""The page's template, in this package's ``templates/`` (shipped in the wheel)."""

_ABOUT = {
    "job": "the job's number in its sweep (a run alone: its directory)",
    "status": "how the job ended: ok, invalid, oom, nan, failed, killed, timeout, interrupted, "
              "not_run, missing, running, corrupt",
    "peak_MiB": "memory at the step's peak (MiB): the sum of the categories",
    **{col: f"{cat} at the peak (MiB)" for cat, col in CATEGORIES},
    "engine_MiB": "a generation engine's own memory (weights, KV cache), outside the peak",
    "tokens_per_s": "training throughput: tokens per second over the timed steps",
    "tps_spread": "the std of the timed steps' tokens/s (what the front allows for)",
    "timed_steps": "the steps timed (2!: under 3, its tokens/s is not timed: shown, not ranked)",
    "padding_frac": "the fraction of the batches' tokens that are padding",
    "final_loss": "the loss of the last optimizer step",
    "eval_loss": "the last evaluation's loss on the held-out data (data.eval)",
    "eval_reward": "the last evaluation's reward on the held-out prompts (data.eval)",
    **{col: f"the peak during the {phase} phase of a step (MiB)" for phase, col in PHASES},
    "pareto": "on the memory-vs-throughput front: no job has less memory and is measurably "
              "faster (not timed: under 3 timed steps, not ranked)",
    "d_peak_MiB": "the peak's change against the baseline (MiB; negative: a saving)",
    "d_peak_pct": "the peak's change against the baseline (percent)",
    **{f"d_{col}": f"the change of {cat} against the baseline (MiB)" for cat, col in CATEGORIES},
    "d_tokens_per_s_pct": "the change of tokens/s against the baseline (percent; positive: "
                          "faster; not timed: either job under 3 timed steps)",
    "run_dir": "the job's directory (its summary.json, memlab.log, checkpoints)",
    "error": "the reason a job did not end ok (all of it under the table)",
}
"""What each column holds (the page's glossary; a varying setting: the setting)."""


def _breakable(text: object) -> Any:
    """``text`` escaped, breakable after each ``_ . / - = ,`` (a long name, setting or path
    wraps there, never cut; a word stays whole): the template's ``breakable`` filter."""
    from markupsafe import Markup, escape

    return Markup(re.sub(r"([_./=,-])", r"\1<wbr>", str(escape(str(text)))))


def _klass(column: str) -> str:
    return "num" if column in NUMERIC_COLUMNS else ("error" if column == "error" else "")


def _under(columns: Sequence[str]) -> dict[str, list[str]]:
    """The ``d_*`` columns of a baseline under the column each changes (``peak_MiB`` ->
    ``d_peak_MiB``, ``d_peak_pct``; ``tokens_per_s`` -> ``d_tokens_per_s_pct``)."""
    out: dict[str, list[str]] = {}
    for d in DELTA_COLUMNS:
        if d in columns:
            base = {"d_peak_pct": "peak_MiB", "d_tokens_per_s_pct": "tokens_per_s"}.get(d, d[2:])
            out.setdefault(base, []).append(d)
    return out


def _delta(column: str, value: object, marked: str | None = None) -> dict[str, str] | None:
    if marked is not None:  # a speed change that is not ranked: said, no colour
        return {"col": column, "text": marked, "sign": ""}
    text = format_cell(column, value)
    if text == "-":  # no change computed (a job, or the baseline, not ok)
        return None
    sign = "less" if text.startswith("-") and text != "-" else (
        "more" if text.startswith("+") and text.strip("+0.%") else "")
    # a saving (less memory) reads green; for tokens/s more is the better way
    if column == "d_tokens_per_s_pct":
        sign = {"less": "more", "more": "less"}.get(sign, "")
    return {"col": column, "text": text, "sign": sign}


def _value(column: str, value: Any) -> float | str | None:
    """A cell as the script sorts and compares it: a number, a text, or None (blank)."""
    if column == "pareto":
        return 1.0 if bool(value) else 0.0
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if math.isfinite(value) else None
    return format_cell(column, value)


def _environment() -> Any:
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("memlab.cli.report", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["breakable"] = _breakable
    return env


def format_html(df: pd.DataFrame, images: Sequence[Path] = (), title: str = "memlab report",
                ) -> str:
    """The whole page as a string (``images``: PNGs to embed)."""
    every = [str(c) for c in df.columns]
    under = _under(every)
    stacked = {d for ds in under.values() for d in ds}
    cols = [c for c in every if c not in stacked and c != "error"]
    params = {str(p) for p in df.attrs.get("params") or []}
    about = {c: _ABOUT.get(c, "a setting that varies across the jobs" if c in params else c)
             for c in every}
    base = baseline_job(df)
    rows = []
    values, texts = [], []
    for rec in df[every].itertuples(index=False):
        cells = dict(zip(every, rec))
        speed = speed_cells(df, cells)  # a speed not ranked: "not timed", and no sort by it
        marked = base is not None and str(cells["job"]) == base
        klass = "baseline" if marked else "front" if cells.get("pareto") else (
            "notok" if cells["status"] != "ok" else "")
        rows.append({
            "klass": klass, "reason": format_cell("error", cells.get("error")),
            "cells": [{"klass": _klass(c), "num": c in NUMERIC_COLUMNS,
                       "text": speed.get(c) or format_cell(c, cells[c]),
                       "mark": marked and c == "job",
                       "deltas": [d for d in (_delta(x, cells[x], speed.get(x))
                                              for x in under.get(c, ())) if d is not None]}
                      for c in cols]})
        values.append([None if c in speed and c != "pareto" else _value(c, cells[c])
                       for c in every])
        texts.append([speed.get(c) or format_cell(c, cells[c]) for c in every])
    failures = [{"job": str(f["job"]), "status": f["status"], "run_dir": str(f["run_dir"]),
                 "error": printable(f["error"].rstrip(), keep_newlines=True)
                 or "(no reason recorded)"} for f in df.attrs.get("failures") or []]
    return _environment().get_template(TEMPLATE).render(
        title=title, fixed=fixed_line(df), baseline=base, notes=notes(df),
        columns=[{"name": c, "about": about[c], "under": under.get(c, [])} for c in cols],
        filterable=every, rows=rows, any_notok=any(r["klass"] == "notok" for r in rows),
        glossary=[{"name": c, "about": about[c]} for c in every],
        images=[{"name": p.name, "data": base64.b64encode(p.read_bytes()).decode("ascii")}
                for p in images],
        failures=failures, data={"columns": every, "rows": values, "texts": texts},
    ) + "\n"
