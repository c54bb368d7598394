"""``memlab report``: tabulate and plot the ``summary.json`` files of runs and sweeps.

Usage::

    memlab report multirun/2025-01-01/12-00-00            # a Hydra multirun (sweep) dir
    memlab report outputs/a outputs/b --sort tokens_per_s --desc
    memlab report multirun/... --out reports/lora --no-plots

Every input is a multirun dir (walked recursively), a run dir or a ``summary.json`` file. Each job
becomes one row: the Hydra choices/overrides that *vary* across jobs (constant ones are listed once
on a ``fixed:`` line), the status with a short reason, the memory at the peak split by category
(MiB), throughput, padding fraction, final loss, and whether the job is on the memory-vs-throughput
Pareto front. Jobs that died before writing a summary (a Hydra job dir with
``.hydra/overrides.yaml`` but no ``summary.json``) show up with status ``missing``; unreadable
summaries with status ``corrupt``.

Outputs (in ``--out``, default: the first input dir): ``report.csv``, ``report.md``,
``memory_by_category.png`` and ``memory_vs_throughput.png``.

This module only reads JSON/YAML files: it never imports torch or transformers, and pandas and
matplotlib are imported lazily, so ``import memlab.cli.report`` is cheap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

SUMMARY_NAME = "summary.json"
"""File name of the per-job summary written by a run."""

OVERRIDES_REL = Path(".hydra") / "overrides.yaml"
HYDRA_REL = Path(".hydra") / "hydra.yaml"

OK = "ok"
MISSING = "missing"
CORRUPT = "corrupt"

MIB = float(2**20)
ERROR_WIDTH = 80
"""Maximum length of the short reason shown in the ``error`` column."""

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("parameters", "params_MiB"),
    ("gradients", "grads_MiB"),
    ("optimizer", "optim_MiB"),
    ("activations", "activ_MiB"),
    ("other", "other_MiB"),
)
"""``memory.by_category`` keys and the table column each one becomes."""

FLOAT_COLUMNS: tuple[str, ...] = (
    "peak_MiB",
    *(col for _, col in CATEGORIES),
    "tokens_per_s",
    "padding_frac",
    "final_loss",
)
METRIC_COLUMNS: tuple[str, ...] = ("status", "error", *FLOAT_COLUMNS, "pareto")
"""Columns every table has after the ``job`` column and the varying parameters."""

DEFAULT_SORT = "peak_MiB"
_SORT_ALIASES = {
    "peak": "peak_MiB",
    "memory": "peak_MiB",
    "mem": "peak_MiB",
    "throughput": "tokens_per_s",
    "tps": "tokens_per_s",
    "loss": "final_loss",
    "padding": "padding_frac",
}
_FORMATS = {
    **{col: "{:.1f}" for col in FLOAT_COLUMNS},
    "padding_frac": "{:.3f}",
    "final_loss": "{:.4f}",
}
_HIDDEN_IN_TEXT = ("run_dir",)
_CATEGORY_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8C8C8C")


# --------------------------------------------------------------------------------------- loading


def _natural_key(name: str) -> list[Any]:
    """Sort key putting ``2`` before ``10`` (Hydra job dirs are numbered)."""
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", name)]


def _discover(root: Path) -> Iterator[Path]:
    """Yield every ``summary.json`` under ``root`` and every Hydra job dir that lacks one.

    Hidden dirs (``.hydra``, ``.git`` ...) are not descended into. The order is a natural sort of
    the paths, so the jobs of a sweep come out as ``0, 1, 2, ..., 10``.
    """
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted((d for d in dirnames if not d.startswith(".")), key=_natural_key)
        here = Path(dirpath)
        if SUMMARY_NAME in filenames:
            yield here / SUMMARY_NAME
        elif (here / OVERRIDES_REL).is_file():
            yield here


def _read_yaml(path: Path) -> Any:
    """Parse a YAML file, returning ``None`` when it is absent or unreadable."""
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None


def _read_overrides(job_dir: Path) -> list[str]:
    """The Hydra task overrides recorded in ``<job_dir>/.hydra/overrides.yaml`` (or ``[]``)."""
    data = _read_yaml(job_dir / OVERRIDES_REL)
    return [str(item) for item in data] if isinstance(data, list) else []


def _read_choices(job_dir: Path) -> dict[str, str]:
    """The config-group choices in ``<job_dir>/.hydra/hydra.yaml`` (Hydra's own groups dropped)."""
    data = _read_yaml(job_dir / HYDRA_REL)
    try:
        choices = data["hydra"]["runtime"]["choices"]
    except (TypeError, KeyError):
        return {}
    if not isinstance(choices, Mapping):
        return {}
    return {
        str(k): str(v)
        for k, v in choices.items()
        if not str(k).startswith("hydra/") and v is not None
    }


def _placeholder(job_dir: Path, status: str, error: str, source: Path) -> dict[str, Any]:
    """A summary-shaped record for a job whose ``summary.json`` is missing or unreadable."""
    num = int(job_dir.name) if job_dir.name.isdigit() else None
    return {
        "status": status,
        "error": error,
        "choices": _read_choices(job_dir),
        "overrides": _read_overrides(job_dir),
        "run_dir": str(job_dir),
        "job": {
            "name": None,
            "num": num,
            "sweep_dir": str(job_dir.parent) if num is not None else None,
        },
        "memory": None,
        "throughput": None,
        "data": None,
        "train": None,
        "_path": str(source),
        "_dir": str(job_dir),
    }


def _load_file(path: Path) -> dict[str, Any]:
    """Load one ``summary.json``; an unreadable one becomes a ``corrupt`` record."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"top level is a JSON {type(data).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        return _placeholder(path.parent, CORRUPT, f"unreadable {path}: {exc}", path)
    data["_path"] = str(path)
    data["_dir"] = str(path.parent)
    return data


def load_summaries(paths: Sequence[Path | str]) -> list[dict[str, Any]]:
    """Load the summaries of every job found under ``paths``.

    Each path may be a multirun dir (walked recursively for ``summary.json``), a run dir, or a
    ``summary.json`` file. A Hydra job dir (one with ``.hydra/overrides.yaml``) without a summary
    yields a record with status ``"missing"`` and the overrides read from that file; a summary
    that is not valid JSON yields status ``"corrupt"`` with the path in ``error``. Every record
    gets ``_path`` (the summary file, or the job dir when missing) and ``_dir`` (the job dir).
    The same job reached through two inputs is returned once.

    Raises:
        FileNotFoundError: if one of ``paths`` does not exist.
    """
    records: list[dict[str, Any]] = []
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            found: list[Path] = [path]
        elif path.is_dir():
            found = list(_discover(path))
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")
        for item in found:
            key = item.resolve()
            if key in seen:
                continue
            seen.add(key)
            if item.is_dir():
                msg = f"no {SUMMARY_NAME} (the job died before writing it; see its log)"
                records.append(_placeholder(item, MISSING, msg, item))
            else:
                records.append(_load_file(item))
    return records


# --------------------------------------------------------------------------------------- table


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points on the Pareto front for *minimizing x* and *maximizing y*.

    Here x is peak memory and y throughput. Point ``j`` dominates point ``i`` when it is at least
    as good on both axes and strictly better on one (``x_j <= x_i`` and ``y_j >= y_i``, not both
    equal). The front is every point no other point dominates, so:

    * equal points do not dominate each other: duplicates are all on the front, or all off it;
    * among points with the same x only those with the highest y remain (and vice versa);
    * a single point is the front, and an empty input gives ``[]``.

    The indices are returned in ascending order. O(n^2), which is fine for sweep-sized inputs.

    Raises:
        ValueError: if a coordinate is NaN or infinite (filter those jobs out first).
    """
    pts = [(float(x), float(y)) for x, y in points]
    for i, (x, y) in enumerate(pts):
        if not (math.isfinite(x) and math.isfinite(y)):
            raise ValueError(f"point {i} is not finite: ({x}, {y})")
    front = []
    for i, (xi, yi) in enumerate(pts):
        dominated = any(
            xj <= xi and yj >= yi and (xj < xi or yj > yi)
            for j, (xj, yj) in enumerate(pts)
            if j != i
        )
        if not dominated:
            front.append(i)
    return front


def _get(mapping: Any, key: str) -> Any:
    """``mapping[key]`` when ``mapping`` is a mapping holding it, else ``None``."""
    return mapping.get(key) if isinstance(mapping, Mapping) else None


def _number(value: Any) -> float | None:
    """``value`` as a float, or ``None`` when it is not a number (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _mib(value: Any) -> float | None:
    """Bytes to MiB (``None`` stays ``None``)."""
    num = _number(value)
    return None if num is None else num / MIB


def short_reason(error: Any, width: int = ERROR_WIDTH) -> str:
    """First non-empty line of ``error``, cut to ``width`` characters (``""`` for no error)."""
    if error is None:
        return ""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return first if len(first) <= width else first[: width - 3] + "..."


def _parse_override(override: str) -> tuple[str, str] | None:
    """Turn a Hydra override into ``(key, value)``; Hydra's own settings give ``None``.

    ``+key=v`` and ``++key=v`` become ``key``; a deletion ``~key`` has the value ``"~"``.
    """
    text = str(override).strip()
    key, sep, value = text.partition("=")
    if key.startswith("~"):
        key, value = key[1:], "~"
    elif not sep:
        return None
    key = key.lstrip("+")
    if not key or key == "hydra" or key.startswith(("hydra.", "hydra/")):
        return None
    return key, value


def _job_params(summary: Mapping[str, Any]) -> tuple[dict[str, str], bool]:
    """The job's choices and overrides as ``{key: value}`` strings, and whether choices are known.

    Choices come first (``peft`` -> ``lora``); an override of the same key (``peft=lora``) agrees
    with the choice and simply replaces it.
    """
    params: dict[str, str] = {}
    choices = summary.get("choices")
    if isinstance(choices, Mapping):
        for key, value in choices.items():
            params[str(key)] = "null" if value is None else str(value)
    overrides = summary.get("overrides")
    if isinstance(overrides, (list, tuple)):
        for item in overrides:
            parsed = _parse_override(item)
            if parsed is not None:
                params[parsed[0]] = parsed[1]
    return params, bool(isinstance(choices, Mapping) and choices)


def _split_params(
    params: Sequence[dict[str, str]], known: Sequence[bool]
) -> tuple[list[str], dict[str, str]]:
    """Split parameter keys into those that vary across jobs and those that are fixed.

    A key absent from a job counts as a distinct value ("default") when the job's choices are
    known, and is ignored when they are not (a ``missing`` job whose ``.hydra`` holds only
    overrides must not make every choice look like it varies).
    """
    keys: list[str] = []
    for p in params:
        keys.extend(k for k in p if k not in keys)
    varying: list[str] = []
    fixed: dict[str, str] = {}
    for key in keys:
        values = {p.get(key) for p, k in zip(params, known) if key in p or k}
        if len(values) > 1:
            varying.append(key)
        elif values and None not in values:
            fixed[key] = next(iter(values))  # type: ignore[assignment]
    return varying, fixed


def _job_ids(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """A short, unique id per job: the Hydra job number, else the job dir name or path."""
    dirs = [Path(str(s.get("_dir") or s.get("run_dir") or ".")) for s in summaries]
    ids = []
    for s, d in zip(summaries, dirs):
        num = _get(s.get("job"), "num")
        ids.append(str(num) if isinstance(num, int) and not isinstance(num, bool) else d.name)
    if len(set(ids)) == len(ids):
        return ids
    try:
        common = Path(os.path.commonpath([str(d.resolve()) for d in dirs]))
        rel = [str(d.resolve().relative_to(common)) or d.name for d in dirs]
    except ValueError:
        rel = [str(d) for d in dirs]
    return rel if len(set(rel)) == len(rel) else [f"{i}:{r}" for i, r in enumerate(rel)]


def _metrics(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The metric columns of one job (``None`` where the summary holds no value)."""
    memory = summary.get("memory")
    by_cat = _get(memory, "by_category")
    row: dict[str, Any] = {
        "status": str(summary.get("status") or "unknown"),
        "error": short_reason(summary.get("error")),
        "peak_MiB": _mib(_get(memory, "peak_bytes")),
    }
    for cat, col in CATEGORIES:
        row[col] = _mib(_get(by_cat, cat))
    row["tokens_per_s"] = _number(_get(summary.get("throughput"), "tokens_per_s"))
    row["padding_frac"] = _number(_get(summary.get("data"), "padding_fraction"))
    row["final_loss"] = _number(_get(summary.get("train"), "final_loss"))
    return row


def build_table(
    summaries: Sequence[Mapping[str, Any]], sort: str | None = None, desc: bool = False
) -> pd.DataFrame:
    """One row per job, sorted (default: peak memory ascending, non-ok jobs last).

    Columns: ``job``, the choices/overrides that vary across jobs, then :data:`METRIC_COLUMNS`
    and ``run_dir``. ``df.attrs`` holds ``fixed`` (``{key: value}`` of the constant parameters),
    ``params`` (the varying parameter columns) and ``failures`` (``[{"job", "status", "error",
    "run_dir"}]`` with the full reason of every non-ok job).
    """
    import pandas as pd

    parsed = [_job_params(s) for s in summaries]
    params = [p for p, _ in parsed]
    varying, fixed = _split_params(params, [k for _, k in parsed])
    ids = _job_ids(summaries)
    metrics = [_metrics(s) for s in summaries]

    candidates = [
        i
        for i, m in enumerate(metrics)
        if m["status"] == OK
        and m["peak_MiB"] is not None
        and m["tokens_per_s"] is not None
        and math.isfinite(m["peak_MiB"])
        and math.isfinite(m["tokens_per_s"])
    ]
    front = pareto_front([(metrics[i]["peak_MiB"], metrics[i]["tokens_per_s"]) for i in candidates])
    on_front = {candidates[j] for j in front}

    records = []
    failures = []
    for i, (s, p, m) in enumerate(zip(summaries, params, metrics)):
        run_dir = str(s.get("_dir") or s.get("run_dir") or "")
        records.append(
            {
                "job": ids[i],
                **{key: p.get(key) for key in varying},
                **m,
                "pareto": i in on_front,
                "run_dir": run_dir,
            }
        )
        if m["status"] != OK:
            err = s.get("error")
            failures.append(
                {
                    "job": ids[i],
                    "status": m["status"],
                    "error": "" if err is None else str(err),
                    "run_dir": run_dir,
                }
            )
    columns = ["job", *varying, *METRIC_COLUMNS, "run_dir"]
    df = pd.DataFrame.from_records(records, columns=columns)
    for col in FLOAT_COLUMNS:
        df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    df["pareto"] = df["pareto"].astype(bool)
    df.attrs.update({"fixed": fixed, "params": varying, "failures": failures})
    return sort_table(df, sort or DEFAULT_SORT, desc)


def resolve_column(df: pd.DataFrame, name: str) -> str:
    """Map a user-given column name to a column of ``df``.

    Accepts the exact name, a case-insensitive match, an alias (``peak``, ``memory``, ``tps``,
    ``throughput``, ``loss``, ``padding``) or an unambiguous case-insensitive prefix.

    Raises:
        KeyError: with the list of available columns.
    """
    cols = [str(c) for c in df.columns]
    if name in cols:
        return name
    low = name.lower()
    exact = [c for c in cols if c.lower() == low]
    if len(exact) == 1:
        return exact[0]
    if low in _SORT_ALIASES and _SORT_ALIASES[low] in cols:
        return _SORT_ALIASES[low]
    prefixed = [c for c in cols if c.lower().startswith(low)]
    if len(prefixed) == 1:
        return prefixed[0]
    what = "ambiguous" if prefixed else "unknown"
    raise KeyError(f"{what} column {name!r}; columns: {', '.join(cols)}")


def sort_table(df: pd.DataFrame, column: str = DEFAULT_SORT, desc: bool = False) -> pd.DataFrame:
    """Sort by ``column`` (ascending unless ``desc``), non-ok jobs always last, blanks last.

    Text columns whose values are all numbers (``train.micro_batch_size=8``) sort numerically.
    Ties keep the job order. ``df.attrs`` is kept.
    """
    import pandas as pd

    col = resolve_column(df, column)
    values = df[col]
    if not pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
        numeric = pd.to_numeric(values, errors="coerce")
        if numeric.notna().sum() == values.notna().sum():
            values = numeric
    tmp = pd.DataFrame(
        {
            "_failed": (df["status"] != OK).to_numpy(),
            "_key": values.to_numpy(),
            "_order": range(len(df)),
        },
        index=df.index,
    )
    order = tmp.sort_values(
        ["_failed", "_key", "_order"], ascending=[True, not desc, True], na_position="last"
    ).index
    out = df.loc[order].reset_index(drop=True)
    out.attrs = dict(df.attrs)
    return out


# --------------------------------------------------------------------------------------- output


def format_cell(column: str, value: Any) -> str:
    """Text of one table cell: fixed decimals for metrics, ``-`` for blanks, ``yes`` on the front."""
    if column == "pareto":
        return "yes" if bool(value) else ""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "" if column == "error" else "-"
    fmt = _FORMATS.get(column)
    if fmt is not None and isinstance(value, (int, float)):
        return fmt.format(value)
    return str(value)


def _text_rows(df: pd.DataFrame) -> tuple[list[str], list[list[str]], list[bool]]:
    """Visible columns (``error`` last), formatted cells, and which columns are numeric."""
    cols = [str(c) for c in df.columns if c not in _HIDDEN_IN_TEXT and c != "error"]
    cols.append("error")  # the widest column goes last so the numbers stay readable
    rows = [[format_cell(c, v) for c, v in zip(cols, rec)] for rec in df[cols].itertuples(False)]
    numeric = [c in FLOAT_COLUMNS for c in cols]
    return cols, rows, numeric


def fixed_line(df: pd.DataFrame) -> str:
    """``fixed: key=value, ...`` for the parameters shared by all jobs."""
    fixed = df.attrs.get("fixed") or {}
    return "fixed: " + (", ".join(f"{k}={v}" for k, v in fixed.items()) or "(none)")


def format_text(df: pd.DataFrame) -> str:
    """The table as plain aligned text, preceded by the ``fixed:`` line."""
    cols, rows, numeric = _text_rows(df)
    widths = [max([len(c)] + [len(r[j]) for r in rows]) for j, c in enumerate(cols)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(w) if num else cell.ljust(w) for cell, w, num in zip(cells, widths, numeric)
        ]
        return "  ".join(parts).rstrip()

    out = [fixed_line(df), "", line(cols), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def format_markdown(df: pd.DataFrame) -> str:
    """The report as markdown: ``fixed:`` line, table, and the full reason of every failed job."""
    cols, rows, numeric = _text_rows(df)
    out = ["# memlab report", "", fixed_line(df), ""]
    out.append("| " + " | ".join(_md_escape(c) for c in cols) + " |")
    out.append("|" + "|".join("---:" if num else "---" for num in numeric) + "|")
    out.extend("| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows)
    failures = df.attrs.get("failures") or []
    if failures:
        out += ["", "## Failed jobs", ""]
        for f in failures:
            out.append(f"### job {f['job']}: `{f['status']}`")
            out.append("")
            out.append(f"run dir: `{f['run_dir']}`")
            out.append("")
            out += ["```text", f["error"].rstrip() or "(no reason recorded)", "```", ""]
    return "\n".join(out).rstrip() + "\n"


def job_label(df: pd.DataFrame, i: int, sep: str = ", ") -> str:
    """Label of row ``i`` for plots: ``#<job>`` followed by its varying parameters."""
    parts = []
    for key in df.attrs.get("params") or []:
        value = df.at[i, key]
        parts.append(f"{key}={'?' if value is None or value != value else value}")
    head = f"#{df.at[i, 'job']}"
    return head + (" " + sep.join(parts) if parts else "")


def _new_figure(width: float, height: float) -> Any:
    """A pyplot-free figure rendered by the Agg backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _excluded_note(df: pd.DataFrame, shown: Sequence[int]) -> str:
    """``not shown: #2 (oom), #3 (missing)`` for the rows left out of a plot."""
    left = [f"#{df.at[i, 'job']} ({df.at[i, 'status']})" for i in range(len(df)) if i not in shown]
    return ("not shown: " + ", ".join(left)) if left else ""


def _add_note(ax: Any, note: str) -> None:
    """Write ``note`` in red under the x-axis label of ``ax`` (nothing when empty)."""
    if note:
        ax.annotate(
            note,
            xy=(0.0, 0.0),
            xycoords="axes fraction",
            xytext=(0, -36),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color="#a00000",
        )


def plot_memory_by_category(df: pd.DataFrame, path: Path) -> Path | None:
    """Horizontal stacked bars of the memory at the peak per category (MiB), one bar per ok job.

    Bars are in table order (top to bottom) and labelled with the varying parameters; the total
    peak is written at the end of each bar. Jobs that are not ok or have no memory figures are
    listed under the plot instead. Returns ``None`` (and writes nothing) when no job qualifies.
    """
    cat_cols = [col for _, col in CATEGORIES]
    shown = [
        i
        for i in range(len(df))
        if df.at[i, "status"] == OK
        and (df.loc[i, cat_cols].notna().any() or not math.isnan(df.at[i, "peak_MiB"]))
    ]
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
        ax.barh(
            ypos,
            rest,
            left=left,
            color="white",
            edgecolor="#8C8C8C",
            hatch="///",
            height=0.7,
            label="unattributed",
        )
    totals = [p if p == p else s for p, s in zip(peaks, left)]
    xmax = max(totals) if max(totals) > 0 else 1.0
    for y, total in zip(ypos, totals):
        ax.text(total + 0.01 * xmax, y, f"{total:.1f}", va="center", fontsize=8)
    ax.set_xlim(0, xmax * 1.12)
    ax.set_yticks(ypos, [job_label(df, i) for i in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("memory at peak (MiB)")
    ax.set_title("Memory at the peak, by category")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    _add_note(ax, _excluded_note(df, shown))
    fig.savefig(path, bbox_inches="tight")
    return path


def plot_memory_vs_throughput(df: pd.DataFrame, path: Path) -> Path | None:
    """Scatter of peak memory (MiB) against throughput (tokens/s) for the ok jobs.

    Points are labelled ``#<job>``; a key to the right gives each job's varying parameters. The
    Pareto front (less memory, more throughput) is drawn in red and connected in memory order.
    Returns ``None`` (and writes nothing) when no job has both numbers.
    """
    shown = [
        i
        for i in range(len(df))
        if df.at[i, "status"] == OK
        and math.isfinite(df.at[i, "peak_MiB"])
        and math.isfinite(df.at[i, "tokens_per_s"])
    ]
    if not shown:
        return None
    xs = [float(df.at[i, "peak_MiB"]) for i in shown]
    ys = [float(df.at[i, "tokens_per_s"]) for i in shown]
    front = [k for k, i in enumerate(shown) if bool(df.at[i, "pareto"])]
    rest = [k for k in range(len(shown)) if k not in front]

    fig = _new_figure(9.0, 5.5)
    ax = fig.add_subplot()
    ax.scatter(
        [xs[k] for k in rest],
        [ys[k] for k in rest],
        s=36,
        color="#4C72B0",
        label="dominated",
        zorder=3,
    )
    line = sorted(front, key=lambda k: (xs[k], ys[k]))
    ax.plot(
        [xs[k] for k in line],
        [ys[k] for k in line],
        color="#C44E52",
        lw=1.5,
        zorder=2,
        marker="o",
        markersize=7,
        label="Pareto front",
    )
    for k, i in enumerate(shown):
        ax.annotate(
            f"#{df.at[i, 'job']}",
            (xs[k], ys[k]),
            xytext=(5, 5),
            textcoords="offset points",
            fontsize=8,
        )
    ax.margins(0.12)
    ax.set_xlabel("peak memory (MiB)  \u2190 better")
    ax.set_ylabel("throughput (tokens/s)  better \u2192")
    ax.set_title("Memory vs throughput")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)

    key = ["jobs (* = on the Pareto front)"]
    for k, i in enumerate(shown):
        mark = "*" if k in front else " "
        key.append(f"{mark} {job_label(df, i)}")
    if df.attrs.get("params"):
        ax.text(
            1.02,
            1.0,
            "\n".join(key),
            transform=ax.transAxes,
            va="top",
            ha="left",
            fontsize=7.5,
            family="monospace",
        )
    _add_note(ax, _excluded_note(df, shown))
    fig.savefig(path, bbox_inches="tight")
    return path


def write_report(df: pd.DataFrame, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write ``report.csv``, ``report.md`` and (unless ``plots`` is false) the PNGs to ``out_dir``.

    Returns the paths written (a plot with nothing to show is skipped).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    csv_path = out_dir / "report.csv"
    df.to_csv(csv_path, index=False)
    written.append(csv_path)
    md_path = out_dir / "report.md"
    md_path.write_text(format_markdown(df), encoding="utf-8")
    written.append(md_path)
    if plots:
        for fn, name in (
            (plot_memory_by_category, "memory_by_category.png"),
            (plot_memory_vs_throughput, "memory_vs_throughput.png"),
        ):
            result = fn(df, out_dir / name)
            if result is not None:
                written.append(result)
    return written


# --------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The ``memlab report`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="memlab report",
        description="Tabulate and plot the summary.json files of memlab runs and sweeps.",
    )
    parser.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="multirun dir, run dir or summary.json (several allowed)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to write report.csv/report.md/PNGs (default: the first input dir)",
    )
    parser.add_argument(
        "--sort",
        default=DEFAULT_SORT,
        metavar="COL",
        help=f"column to sort by (default: {DEFAULT_SORT}); non-ok jobs always come last",
    )
    parser.add_argument("--desc", action="store_true", help="sort descending")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``memlab report``; returns 0, or 2 when nothing can be reported."""
    args = build_parser().parse_args(argv)
    absent = [str(p) for p in args.paths if not p.exists()]
    if absent:
        print(f"memlab report: no such file or directory: {', '.join(absent)}", file=sys.stderr)
        return 2
    summaries = load_summaries(args.paths)
    where = ", ".join(str(p) for p in args.paths)
    if not any(s.get("status") != MISSING for s in summaries):
        msg = f"memlab report: no {SUMMARY_NAME} found under {where}"
        if summaries:
            dirs = ", ".join(str(s["_dir"]) for s in summaries)
            msg += f" (only Hydra job dirs without a summary: {dirs})"
        print(msg, file=sys.stderr)
        return 2
    try:
        df = build_table(summaries, sort=args.sort, desc=args.desc)
    except KeyError as exc:
        print(f"memlab report: --sort: {exc.args[0]}", file=sys.stderr)
        return 2
    print(format_text(df))
    first = args.paths[0]
    out_dir = args.out if args.out is not None else (first if first.is_dir() else first.parent)
    written = write_report(df, out_dir, plots=not args.no_plots)
    ok = int((df["status"] == OK).sum())
    print(f"\n{len(df)} job(s), {ok} ok, {len(df) - ok} not ok; wrote:")
    for path in written:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
