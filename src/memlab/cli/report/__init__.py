"""``memlab report``: tabulate and plot the ``summary.json`` files of runs and sweeps.

Usage::

    memlab report multirun/2025-01-01/12-00-00            # a Hydra multirun (sweep) dir
    memlab report outputs/a outputs/b --sort tokens_per_s --desc
    memlab report multirun/... --out reports/lora --budget 24GiB --html
    memlab report multirun/... --baseline peft=none         # what each job saves and costs
    memlab report multirun/... --baseline peft=none train.gradient_checkpointing=true
    memlab report multirun/... --wide      # every column (by default the table fits 120)

Every input is a multirun dir (walked recursively), a run dir or a ``summary.json`` file. Each job
becomes one row (:mod:`.table`): the Hydra choices/overrides that *vary* across jobs (constant
ones are listed once on a ``fixed:`` line), the status with its reason, the memory at the peak
split by category (MiB), throughput with the number of timed steps and their spread, padding
fraction, final loss, the final loss on held-out data (``eval_loss``, runs with ``data.eval``),
with ``--baseline JOB`` (or ``--baseline KEY=VALUE ...``) the change in memory and tokens/s against that job (:mod:`.baseline`),
and whether the job is on the memory-vs-throughput Pareto front (less
memory and *measurably* more tokens/s: throughputs closer than their spread do not count as
different); a line under the table names the fastest job and those tied with it. Speed is
judged as ``memlab fit`` judges it (:mod:`memlab.measure.speed`): a job timed on fewer than
three steps is "not timed", its tokens/s shown (marked) but never ranked: not the fastest, not
on the front, no change against a baseline, last in a sort by speed. Every status a run or its launcher records is shown as it is (ok, invalid, oom, nan,
failed, killed, timeout, interrupted, not_run: :mod:`memlab.measure.outcome`), with the steps
measured before the end; the last line counts the jobs by status. Jobs that died before writing a
summary (a Hydra job dir with
``.hydra/overrides.yaml`` but no ``summary.json``) show up with status ``missing``, or
``running`` when a live process still holds the job dir's lock (:func:`memlab.rundir.in_use`);
unreadable
summaries, and those that are not a summary this memlab reads (a key or a type its typed record,
:mod:`memlab.measure.schema`, does not have; a newer ``schema_version``), with status ``corrupt``
and the reason (:mod:`.load`); a summary written before ``schema_version`` is read as that layout.

Outputs (in ``--out``, default: the first input dir): ``report.csv``, ``report.md``, the plots
``memory_by_category.png``, ``memory_by_phase.png``, ``memory_vs_throughput.png`` (:mod:`.plots`,
with a ``--budget`` line) and ``loss_curves.png``, and with ``--html`` a self-contained ``report.html`` (:mod:`.page`).

This package reads JSON/YAML files only: it never imports torch or transformers, and pandas and
matplotlib (the ``report`` extra) are imported lazily, so ``import memlab.cli.report`` is cheap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from memlab.cli.report.baseline import BaselineError, add_baseline
from memlab.cli.report.load import MISSING, SUMMARY_NAME, load_summaries
from memlab.cli.report.table import (
    ASSUMED_SPREAD,
    DEFAULT_SORT,
    build_table,
    pareto_front,
    short_reason,
    sort_table,
)
from memlab.cli.report.text import WIDTH, fixed_line, format_markdown, format_text
from memlab.measure.outcome import count_line

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["BaselineError", "add_baseline", "build_parser", "build_table", "fixed_line", "format_markdown", "format_text",
           "load_summaries", "main", "pareto_front", "short_reason", "sort_table",
           "write_report"]


def write_report(df: pd.DataFrame, out_dir: Path, plots: bool = True,
                 budget_bytes: int | None = None, html: bool = False) -> list[Path]:
    """Write ``report.csv``, ``report.md``, (unless ``plots`` is false) the PNGs and (with
    ``html``) ``report.html`` to ``out_dir``. Returns the paths written (a plot with nothing to
    show is skipped)."""
    from memlab.measure.console import csv_cell
    from memlab.measure.summary import write_text_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    csv_path = out_dir / "report.csv"  # (every file replaces a link there, never follows it)
    write_text_atomic(csv_path, df.map(csv_cell).to_csv(index=False))  # no cell is a formula
    written.append(csv_path)
    images: list[Path] = []
    if plots:
        from memlab.cli.report.plots import PLOTS

        budget_mib = None if budget_bytes is None else budget_bytes / 2**20
        for fn, name in PLOTS:
            result = fn(df, out_dir / name, budget_mib)
            if result is not None:
                images.append(result)
    md_path = out_dir / "report.md"
    write_text_atomic(md_path, format_markdown(df, [p.name for p in images]))
    written.append(md_path)
    written += images
    if html:
        from memlab.cli.report.page import format_html

        page = out_dir / "report.html"
        write_text_atomic(page, format_html(df, images))
        written.append(page)
    return written


class _Parser(argparse.ArgumentParser):
    """``--baseline`` takes one or more values: paths after its ``key=value`` pairs (or after
    its job id) are paths; at least one path is required."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if ns.baseline:
            first, *more = ns.baseline
            ns.baseline = [first, *(b for b in more if "=" in b)]
            ns.paths = [*ns.paths, *(Path(b) for b in more if "=" not in b)]
        if not ns.paths:
            self.error("the following arguments are required: PATH")
        return ns, rest


def build_parser() -> argparse.ArgumentParser:
    """The ``memlab report`` argument parser."""
    parser = _Parser(
        prog="memlab report",
        description="Tabulate and plot the summary.json files of memlab runs and sweeps.",
    )
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                        help="multirun dir, run dir or summary.json (several allowed)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where to write report.csv/report.md/PNGs (default: the first "
                             "input dir)")
    parser.add_argument("--sort", default=DEFAULT_SORT, metavar="COL",
                        help=f"column to sort by (default: {DEFAULT_SORT}); non-ok jobs always "
                             "come last")
    parser.add_argument("--desc", action="store_true", help="sort descending")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--wide", action="store_true",
                        help="print every column of the table, however wide (by default it fits "
                             "120 columns, and a line under it says what it left out)")
    parser.add_argument("--budget", metavar="SIZE", default=None,
                        help="memory per device drawn on the memory plots, e.g. 24GiB, 80GB")
    parser.add_argument("--html", action="store_true",
                        help="also write report.html: the table and the plots on one page")
    parser.add_argument("--baseline", metavar="JOB|KEY=VALUE", nargs="+", default=None,
                        help="add each job's change in peak memory (and by category) and in "
                             "tokens/s against this job: a job id (the job column), or the "
                             "overrides one job has together, e.g. --baseline peft=none "
                             "train.gradient_checkpointing=true")
    parser.add_argument("--assumed-spread", type=float, default=ASSUMED_SPREAD, metavar="F",
                        help="tokens/s spread (a fraction) assumed for a timed job whose summary "
                             f"holds none (default {ASSUMED_SPREAD})")
    return parser


def _missing_extra(plots: bool, html: bool = False) -> str | None:
    """One line naming the extra when pandas (or, for plots, matplotlib; for --html, jinja2) is
    not installed."""
    from memlab._guards import has

    wanted = ("pandas", *(("matplotlib",) if plots else ()), *(("jinja2",) if html else ()))
    absent = [m for m in wanted if not has(m)]
    if not absent:
        return None
    instead = {"matplotlib": " (or pass --no-plots)", "jinja2": " (or leave out --html)"}
    return (f"memlab report needs {' and '.join(absent)}, from the 'report' extra: "
            "pip install 'memlab[report]'" + (instead[absent[0]] if len(absent) == 1
                                              and absent[0] in instead else ""))


def main(argv: list[str] | None = None) -> int:
    """Run ``memlab report``; returns 0, or 2 when nothing can be reported."""
    from memlab.measure.console import printable

    args = build_parser().parse_args(argv)
    err = _missing_extra(not args.no_plots, args.html)
    if err:
        print(err, file=sys.stderr)
        return 2
    budget = None
    if args.budget is not None:
        from memlab.measure.summary import parse_bytes

        try:
            budget = parse_bytes(args.budget)
        except ValueError as e:
            print(f"memlab report: --budget: {e}", file=sys.stderr)
            return 2
    absent = [str(p) for p in args.paths if not p.exists()]
    if absent:
        print(printable(f"memlab report: no such file or directory: {', '.join(absent)}"), file=sys.stderr)
        return 2
    summaries = load_summaries(args.paths)
    where = ", ".join(str(p) for p in args.paths)
    if not any(s.get("status") != MISSING for s in summaries):
        msg = f"memlab report: no {SUMMARY_NAME} found under {where}"
        if summaries:
            dirs = ", ".join(str(s["_dir"]) for s in summaries)
            msg += f" (only Hydra job dirs without a summary: {dirs})"
        print(printable(msg), file=sys.stderr)
        return 2
    try:
        df = build_table(summaries, sort=args.sort, desc=args.desc,
                         assumed_spread=args.assumed_spread)
    except KeyError as exc:
        print(f"memlab report: --sort: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.baseline is not None:
        try:
            df = add_baseline(df, args.baseline)
        except BaselineError as exc:
            print(printable(f"memlab report: {exc}"), file=sys.stderr)
            return 2
    print(format_text(df, width=None if args.wide else WIDTH))
    first = args.paths[0]
    out_dir = args.out if args.out is not None else (first if first.is_dir() else first.parent)
    written = write_report(df, out_dir, plots=not args.no_plots, budget_bytes=budget,
                           html=args.html)
    print(f"\n{count_line(df['status'])}; wrote:")
    for path in written:
        print(f"  {printable(str(path))}")
    return 0
