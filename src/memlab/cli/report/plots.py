"""``memlab report``, the plots (matplotlib's Agg backend, no pyplot): memory at the peak by
category and by phase, one bar per job, and memory against throughput with the Pareto front as
a staircase; the loss curves overlaid; every job labelled by what varies across the jobs;
``--budget`` drawn as a line."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlab.cli.report.load import OK
from memlab.cli.report.table import ASSUMED_SPREAD, CATEGORIES, PHASES
from memlab.measure.speed import MIN_TIMED, NOT_TIMED
from memlab.measure.summary import short_label

if TYPE_CHECKING:
    import pandas as pd

_CATEGORY_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8C8C8C")
_PHASE_COLORS = {"generate": "#8172B3", "forward": "#4C72B0", "backward": "#C44E52",
                 "optimizer": "#55A868", "eval": "#CCB974"}
_BUDGET_COLOR = "#a00000"


def point_label(df: pd.DataFrame, i: int) -> str:
    """What distinguishes row ``i``: its values of the varying parameters, keys shortened
    (``peft=lora,gradient_checkpointing=false``); ``#<job>`` when nothing varies."""
    pairs = []
    for key in df.attrs.get("params") or []:
        value = df.at[i, key]
        pairs.append((key, "?" if value is None or value != value else value))
    return short_label(pairs, sep=", ") or f"#{df.at[i, 'job']}"


def job_label(df: pd.DataFrame, i: int) -> str:
    """``#<job> <what varies>`` for the rows of the bar plots."""
    label = point_label(df, i)
    head = f"#{df.at[i, 'job']}"
    return head if label == head else f"{head} {label}"


def _new_figure(width: float, height: float) -> Any:
    """A pyplot-free figure rendered by the Agg backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _excluded_note(df: pd.DataFrame, shown: Sequence[int], untimed: Sequence[str] = ()) -> str:
    """``not shown: #2 (oom), #3 (missing)`` for the rows left out of a plot (an ok job in
    ``untimed``: ``(not timed)``)."""
    left = [f"#{df.at[i, 'job']} ("
            + (NOT_TIMED if str(df.at[i, "job"]) in untimed else str(df.at[i, "status"])) + ")"
            for i in range(len(df)) if i not in shown]
    return ("not shown: " + ", ".join(left)) if left else ""


def _add_note(ax: Any, note: str) -> None:
    """Write ``note`` in red under the x-axis label of ``ax`` (nothing when empty)."""
    if note:
        ax.annotate(note, xy=(0.0, 0.0), xycoords="axes fraction", xytext=(0, -36),
                    textcoords="offset points", va="top", fontsize=8, color="#a00000")


def _budget_line(ax: Any, budget_mib: float | None) -> None:
    """The memory budget as a dashed vertical line, labelled in the legend."""
    if budget_mib is None:
        return
    label = (f"budget {budget_mib / 1024:.1f} GiB" if budget_mib >= 1024
             else f"budget {budget_mib:.0f} MiB")
    ax.axvline(budget_mib, color=_BUDGET_COLOR, ls="--", lw=1.3, label=label, zorder=1)


def _ok_with(df: pd.DataFrame, cols: Sequence[str]) -> list[int]:
    return [i for i in range(len(df)) if df.at[i, "status"] == OK
            and (df.loc[i, list(cols)].notna().any() or not math.isnan(df.at[i, "peak_MiB"]))]


def _finish_bars(fig: Any, ax: Any, df: pd.DataFrame, shown: list[int], xmax: float,
                 title: str, budget_mib: float | None) -> Any:
    if budget_mib is not None:
        xmax = max(xmax, budget_mib)
        _budget_line(ax, budget_mib)
    ax.set_xlim(0, xmax * 1.12)
    ax.set_yticks(list(range(len(shown))), [job_label(df, i) for i in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("memory at peak (MiB)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    _add_note(ax, _excluded_note(df, shown))
    return fig


def _save(fig: Any, path: Path) -> Path | None:
    from memlab.measure.summary import unlink_link

    if fig is None:
        return None
    unlink_link(path)  # a link there is replaced, never followed
    fig.savefig(path, bbox_inches="tight")
    return path


def plot_memory_by_category(df: pd.DataFrame, path: Path,
                            budget_mib: float | None = None) -> Path | None:
    """Write :func:`memory_by_category_figure` to ``path`` (None: nothing to show)."""
    return _save(memory_by_category_figure(df, budget_mib), path)


def plot_memory_by_phase(df: pd.DataFrame, path: Path,
                         budget_mib: float | None = None) -> Path | None:
    """Write :func:`memory_by_phase_figure` to ``path`` (None: nothing to show)."""
    return _save(memory_by_phase_figure(df, budget_mib), path)


def plot_memory_vs_throughput(df: pd.DataFrame, path: Path,
                              budget_mib: float | None = None) -> Path | None:
    """Write :func:`memory_vs_throughput_figure` to ``path`` (None: nothing to show)."""
    return _save(memory_vs_throughput_figure(df, budget_mib), path)


def memory_by_category_figure(df: pd.DataFrame, budget_mib: float | None = None) -> Any:
    """Horizontal stacked bars of the memory at the peak per category (MiB), one bar per ok job.

    Bars are in table order (top to bottom) and labelled with the varying parameters; the total
    peak is written at the end of each bar. Jobs that are not ok or have no memory figures are
    listed under the plot instead. ``None`` when no job qualifies.
    """
    cat_cols = [col for _, col in CATEGORIES]
    shown = _ok_with(df, cat_cols)
    if not shown:
        return None
    n = len(shown)
    fig = _new_figure(10.0, max(2.8, 0.42 * n + 1.9))
    ax = fig.add_subplot()
    ypos = list(range(n))
    left = [0.0] * n
    for (cat, col), color in zip(CATEGORIES, _CATEGORY_COLORS):
        widths = [float(df.at[i, col]) if df.at[i, col] == df.at[i, col] else 0.0 for i in shown]
        ax.barh(ypos, widths, left=left, color=color, label=cat, height=0.7, edgecolor="white")
        left = [a + b for a, b in zip(left, widths)]
    # Memory the summary could not attribute to a category (only when by_category is incomplete).
    peaks = [float(df.at[i, "peak_MiB"]) for i in shown]
    rest = [p - s if p == p and p - s > 0.005 * p else 0.0 for p, s in zip(peaks, left)]
    if any(rest):
        ax.barh(ypos, rest, left=left, color="white", edgecolor="#8C8C8C", hatch="///",
                height=0.7, label="unattributed")
    totals = [p if p == p else s for p, s in zip(peaks, left)]
    xmax = max(totals) if max(totals) > 0 else 1.0
    for y, total in zip(ypos, totals):
        ax.text(total + 0.01 * xmax, y, f"{total:.1f}", va="center", fontsize=8)
    return _finish_bars(fig, ax, df, shown, xmax, "Memory at the peak, by category",
                        budget_mib)


def memory_by_phase_figure(df: pd.DataFrame, budget_mib: float | None = None) -> Any:
    """Grouped horizontal bars: each ok job's peak in every phase of a step (generate, forward,
    backward, optimizer; MiB), so the phase that sets the peak stands out. ``None`` when no job
    has phase figures."""
    phases = [(p, col) for p, col in PHASES if df[col].notna().any()]
    if not phases:
        return None
    shown = [i for i in _ok_with(df, [col for _, col in phases])
             if df.loc[i, [col for _, col in phases]].notna().any()]
    if not shown:
        return None
    n, k = len(shown), len(phases)
    fig = _new_figure(10.0, max(2.8, (0.18 * k + 0.2) * n + 1.9))
    ax = fig.add_subplot()
    height = 0.8 / k
    xmax = 1.0
    for j, (phase, col) in enumerate(phases):
        ys = [y - 0.4 + height * (j + 0.5) for y in range(n)]
        vals = [float(df.at[i, col]) if df.at[i, col] == df.at[i, col] else 0.0 for i in shown]
        ax.barh(ys, vals, height=height, color=_PHASE_COLORS.get(phase), label=phase,
                edgecolor="white")
        xmax = max(xmax, *vals)
    return _finish_bars(fig, ax, df, shown, xmax, "Peak memory by phase of the step",
                        budget_mib)


def memory_vs_throughput_figure(df: pd.DataFrame, budget_mib: float | None = None) -> Any:
    """Peak memory (MiB) against throughput (tokens/s) for the ok jobs whose tokens/s is timed
    (at least three timed steps; the others are named under the plot, ``not timed``), each point
    labelled by what varies, with its tokens/s spread as an error bar (grey and a hollow marker
    where the summary holds no spread and the front assumed one). The Pareto front is the
    staircase of the best throughput reachable within each amount of memory. ``None`` when no
    job has both numbers."""
    untimed = {str(j) for j in df.attrs.get("untimed") or []}
    shown = [i for i in range(len(df)) if df.at[i, "status"] == OK
             and str(df.at[i, "job"]) not in untimed
             and math.isfinite(df.at[i, "peak_MiB"]) and math.isfinite(df.at[i, "tokens_per_s"])]
    if not shown:
        return None
    xs = [float(df.at[i, "peak_MiB"]) for i in shown]
    ys = [float(df.at[i, "tokens_per_s"]) for i in shown]
    unmeasured = set(df.attrs.get("unmeasured") or [])
    assumed = float(df.attrs.get("assumed_spread", ASSUMED_SPREAD))
    measured = [str(df.at[i, "job"]) not in unmeasured for i in shown]
    errs = [float(df.at[i, "tps_spread"]) if m else assumed * y
            for i, m, y in zip(shown, measured, ys)]
    front = [k for k, i in enumerate(shown) if bool(df.at[i, "pareto"])]

    fig = _new_figure(9.5, 5.8)
    ax = fig.add_subplot()
    labelled: set[bool] = set()
    for k in range(len(shown)):
        on = k in front
        color = "#C44E52" if on else "#4C72B0"
        # tokens/s cannot go below zero: the bar stops there
        yerr = [[min(errs[k], ys[k])], [errs[k]]]
        label = None if on in labelled else ("a job on the Pareto front" if on else "a job")
        labelled.add(on)  # (the legend names each kind of point once)
        ax.errorbar(xs[k], ys[k], yerr=yerr, fmt="o", ms=7 if on else 6, capsize=3,
                    color=color if measured[k] else "#999999",
                    mfc=color if measured[k] else "white", mec=color, zorder=3, label=label)
    stairs = sorted(front, key=lambda k: (xs[k], ys[k]))
    if stairs:
        xmax = max(xs) * 1.15
        sx = [xs[k] for k in stairs] + [xmax]
        sy = [ys[k] for k in stairs] + [ys[stairs[-1]]]
        ax.step(sx, sy, where="post", color="#C44E52", lw=1.5, zorder=2,
                label="Pareto front: best tokens/s within the memory")
    for k, i in enumerate(shown):
        ax.annotate(point_label(df, i), (xs[k], ys[k]), xytext=(5, 5),
                    textcoords="offset points", fontsize=7.5)
    _budget_line(ax, budget_mib)
    ax.margins(0.12)
    ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))  # no axis below zero tokens/s
    ax.set_xlabel("peak memory (MiB)  \u2190 better")
    ax.set_ylabel("throughput (tokens/s)  better \u2192")
    ax.set_title("Memory vs throughput (error bars: tokens/s spread over the timed steps)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    notes = [_excluded_note(df, shown, sorted(untimed))]
    if untimed:
        notes.append(f"{NOT_TIMED}: fewer than {MIN_TIMED} timed steps, not ranked")
    if not all(measured):
        notes.append(f"hollow: no spread in the summary, {assumed:.0%} assumed")
    _add_note(ax, "; ".join(n for n in notes if n))
    return fig


CURVE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                "#7f7f7f", "#bcbd22", "#17becf")
"""Ten qualitative colours (matplotlib's tab10: one hue each, told apart at a glance)."""
_LINE_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v")


def curve_style(k: int) -> dict[str, str]:
    """The ``k``-th curve's colour, line style and marker: the ten colours first, then the ten
    again in the next line style, then (past 40 curves) the next marker; no two curves of 200
    share all three."""
    return {"color": CURVE_COLORS[k % 10], "ls": _LINE_STYLES[k // 10 % 4],
            "marker": _MARKERS[k // 40 % 5]}


def plot_loss_curves(df: pd.DataFrame, path: Path,
                     budget_mib: float | None = None) -> Path | None:
    """Write :func:`loss_curves_figure` to ``path`` (None: nothing to show; no budget)."""
    return _save(loss_curves_figure(df), path)


def loss_curves_figure(df: pd.DataFrame) -> Any:
    """The loss of every optimizer step (from 1), one line per ok job that recorded a curve,
    labelled ``#<job> <what varies>``, overlaid: techniques that keep the training the same
    draw one line. ``None`` when no job has a curve."""
    curves = df.attrs.get("loss_curves") or {}
    shown = [i for i in range(len(df)) if str(df.at[i, "job"]) in curves]
    if not shown:
        return None
    fig = _new_figure(9.5, 5.2)
    ax = fig.add_subplot()
    for k, i in enumerate(shown):  # every line its own colour and style: see curve_style
        ys = curves[str(df.at[i, "job"])]
        ax.plot(list(range(1, len(ys) + 1)), ys, ms=3, lw=1.2, **curve_style(k),
                label=job_label(df, i))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("Loss per optimizer step", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False)
    _add_note(ax, _excluded_note(df, shown))
    return fig


PLOTS = (
    (plot_memory_by_category, "memory_by_category.png"),
    (plot_memory_by_phase, "memory_by_phase.png"),
    (plot_memory_vs_throughput, "memory_vs_throughput.png"),
    (plot_loss_curves, "loss_curves.png"),
)
"""Every plot of a report and its file name, in the order a page shows them."""
