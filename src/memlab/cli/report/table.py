"""``memlab report``, the table: one row per job with the parameters that vary across jobs, the
status and its reason, memory at the peak by category and by phase, throughput with its timed
steps and spread, padding, loss, and whether the job is on the memory-vs-throughput Pareto front
(its text and Markdown forms: :mod:`.text`). pandas is imported lazily.

Speed is judged by the rule ``memlab fit`` uses (:mod:`memlab.measure.speed`): a job's tokens/s
enters the front, the fastest, a sort by speed and ``--baseline``'s change only from at least
three timed steps (fewer: "not timed", its tokens/s shown but never ranked), and two tokens/s
differ only beyond the larger of their two spreads."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlab.cli.report.load import OK
from memlab.measure.speed import faster, tied, timed
from memlab.measure.summary import user_choices

if TYPE_CHECKING:
    import pandas as pd

MIB = float(2**20)
ASSUMED_SPREAD = 0.05
"""Relative tokens/s spread assumed for a timed job whose summary holds no spread (no
``throughput.tokens_per_s_std``)."""
SPEED_COLUMNS = ("tokens_per_s", "d_tokens_per_s_pct")
"""Columns a sort by speed reads: a job that is not timed sorts with the blanks (last)."""

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("parameters", "params_MiB"),
    ("gradients", "grads_MiB"),
    ("optimizer", "optim_MiB"),
    ("activations", "activ_MiB"),
    ("other", "other_MiB"),
)
"""``memory.by_category`` keys and the table column each one becomes."""
PHASES: tuple[tuple[str, str], ...] = (
    ("generate", "generate_MiB"),
    ("forward", "forward_MiB"),
    ("backward", "backward_MiB"),
    ("optimizer", "optimizer_MiB"),
    ("eval", "eval_MiB"),
)
"""``memory.by_phase`` keys and their columns (in the CSV and HTML; the text table leaves them
out to stay readable). ``eval``: evaluating on held-out data (``data.eval``)."""

FLOAT_COLUMNS: tuple[str, ...] = (
    "peak_MiB",
    *(col for _, col in CATEGORIES),
    "tokens_per_s",
    "tps_spread",
    "timed_steps",
    "padding_frac",
    "final_loss",
    *(col for _, col in PHASES),
)
ENGINE_COLUMN = "engine_MiB"
"""A generation engine's own memory (``memory.generation_engine``: weights, buffers, KV cache;
not in the tracker's peak), after ``other_MiB``: only in tables where some job has one."""
METRIC_COLUMNS: tuple[str, ...] = ("status", "error", *FLOAT_COLUMNS, "pareto")
"""Columns every table has after the ``job`` column and the varying parameters."""
EVAL_COLUMNS: tuple[tuple[str, str], ...] = (("loss", "eval_loss"), ("reward", "eval_reward"))
"""``eval.final`` keys (the last evaluation on the held-out data, ``data.eval``) and their
columns, after ``final_loss``: only in tables where some job has one."""
DELTA_COLUMNS: tuple[str, ...] = (
    "d_peak_MiB", "d_peak_pct", *(f"d_{col}" for _, col in CATEGORIES), "d_tokens_per_s_pct")
"""The change against a baseline job (``--baseline``, :mod:`.baseline`), after ``pareto``."""
NUMERIC_COLUMNS = (*FLOAT_COLUMNS, ENGINE_COLUMN, *(c for _, c in EVAL_COLUMNS), *DELTA_COLUMNS)
"""Every numeric column (right-aligned)."""

DEFAULT_SORT = "peak_MiB"
_SORT_ALIASES = {
    "peak": "peak_MiB",
    "memory": "peak_MiB",
    "mem": "peak_MiB",
    "throughput": "tokens_per_s",
    "tps": "tokens_per_s",
    "loss": "final_loss",
    "padding": "padding_frac",
    "eval": "eval_loss",
}
def pareto_front(points: Sequence[tuple[float, float]],
                 spreads: Sequence[float] | None = None) -> list[int]:
    """Indices of the points on the Pareto front for *minimizing x* and *maximizing y*.

    Here x is peak memory (measured exactly) and y throughput, measured with a spread: ``spreads``
    gives each point's (absolute, in y's unit; default 0). Two throughputs differ only when they
    are further apart than the larger of their two spreads (:func:`memlab.measure.speed.faster`).
    Point ``j`` dominates point ``i`` when it uses at most as much memory, is not measurably
    slower, and is strictly better on one axis: ``x_j <= x_i``, ``y_j >= y_i - s``, and ``x_j <
    x_i`` or ``y_j > y_i + s`` with ``s = max(s_i, s_j)``. The front is every point no other point dominates, so:

    * a point that needs more memory is on the front only when it is measurably faster than
      every point that needs less: the front sorted by memory is a staircase, rising at each
      step by more than the spread;
    * equal points do not dominate each other: duplicates are all on the front, or all off it;
    * a single point is the front, and an empty input gives ``[]``.

    The indices are returned in ascending order. O(n^2), which is fine for sweep-sized inputs.

    Raises:
        ValueError: if a coordinate or spread is NaN or infinite (filter those jobs out first).
    """
    pts = [(float(x), float(y)) for x, y in points]
    sp = [0.0] * len(pts) if spreads is None else [float(s) for s in spreads]
    for i, ((x, y), s) in enumerate(zip(pts, sp)):
        if not (math.isfinite(x) and math.isfinite(y) and math.isfinite(s)):
            raise ValueError(f"point {i} is not finite: ({x}, {y}) +- {s}")
    front = []
    for i, (xi, yi) in enumerate(pts):
        dominated = False
        for j, (xj, yj) in enumerate(pts):
            if (j != i and xj <= xi and not faster(yi, sp[i], yj, sp[j])
                    and (xj < xi or faster(yj, sp[j], yi, sp[i]))):
                dominated = True
                break
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



def short_reason(error: Any) -> str:
    """The reason of ``error`` on one line, whole: its first non-empty line, or, when that line
    only announces a list (``invalid configuration (2 problem(s)):``), the items of the list
    joined with ``; `` (``""`` for no error). The full text stays in the Markdown and HTML."""
    if error is None:
        return ""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].endswith(":") and len(lines) > 1:
        items = []
        for line in lines[1:]:
            if not line.startswith(("- ", "* ")):
                break
            items.append(line[2:].strip())
        if items:
            return "; ".join(items)
    return lines[0]


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
        for key, value in user_choices(choices).items():
            params[key] = value
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
        elif len(values) == 1 and (only := next(iter(values))) is not None:
            fixed[key] = only
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
    by_phase = _get(memory, "by_phase")
    tput = summary.get("throughput")
    row: dict[str, Any] = {
        "status": str(summary.get("status") or "unknown"),
        "error": short_reason(summary.get("error")),
        "peak_MiB": _mib(_get(memory, "peak_bytes")),
    }
    for cat, col in CATEGORIES:
        row[col] = _mib(_get(by_cat, cat))
    row["tokens_per_s"] = _number(_get(tput, "tokens_per_s"))
    row["tps_spread"] = _number(_get(tput, "tokens_per_s_std"))
    row["timed_steps"] = _number(_get(tput, "timed_steps"))
    row["padding_frac"] = _number(_get(summary.get("data"), "padding_fraction"))
    row["final_loss"] = _number(_get(summary.get("train"), "final_loss"))
    for phase, col in PHASES:
        row[col] = _mib(_get(by_phase, phase))
    final = _get(summary.get("eval"), "final")
    for key, col in EVAL_COLUMNS:
        row[col] = _number(_get(final, key))
    engine = _get(memory, "generation_engine")  # a vLLM engine's own memory, beside the peak
    row[ENGINE_COLUMN] = (None if not isinstance(engine, Mapping) else
                          _mib(sum(_number(engine.get(k)) or 0 for k in
                                   ("weights_bytes", "buffers_bytes", "kv_cache_bytes"))))
    return row


def speed_spread(tokens_per_s: float, spread: float | None, assumed: float = ASSUMED_SPREAD,
                 ) -> tuple[float, bool]:
    """(the tokens/s spread a timed job is judged with, whether it was measured): its own, or
    ``assumed`` of its tokens/s where its summary holds none."""
    if spread is not None and math.isfinite(spread):
        return float(spread), True
    return assumed * tokens_per_s, False


def _fastest(ids: Sequence[str], speeds: Sequence[tuple[float, float]]) -> dict[str, Any] | None:
    """The timed job with the most tokens/s, and those tied with it (within the larger of the
    two spreads: the measurement does not order them); None without a timed job."""
    if not speeds:
        return None
    top = max(range(len(speeds)), key=lambda k: speeds[k][0])
    with_top = [ids[k] for k in range(len(speeds))
                if k != top and tied(*speeds[top], *speeds[k])]
    return {"job": ids[top], "tokens_per_s": speeds[top][0], "tied": with_top}


def build_table(
    summaries: Sequence[Mapping[str, Any]], sort: str | None = None, desc: bool = False,
    assumed_spread: float = ASSUMED_SPREAD,
) -> pd.DataFrame:
    """One row per job, sorted (default: peak memory ascending, non-ok jobs last).

    Columns: ``job``, the choices/overrides that vary across jobs, then :data:`METRIC_COLUMNS`
    and ``run_dir``. ``df.attrs`` holds ``fixed`` (``{key: value}`` of the constant parameters),
    ``params`` (the varying parameter columns), ``failures`` (``[{"job", "status", "error",
    "run_dir"}]`` with the full reason of every non-ok job), ``untimed`` (the ok jobs whose
    tokens/s is not timed: fewer than :data:`~memlab.measure.speed.MIN_TIMED` timed steps, never
    ranked), ``fastest`` (``{"job", "tokens_per_s", "tied"}``: the timed job with the most
    tokens/s and the jobs within the larger of the two spreads of it; None when no job is
    timed), ``unmeasured`` (timed jobs whose summary holds no tokens/s spread: the front assumed
    ``assumed_spread`` of their tokens/s), ``assumed_spread`` and ``loss_curves`` (``{job: [loss
    per optimizer step]}`` of the ok jobs that recorded one).
    """
    import pandas as pd

    parsed = [_job_params(s) for s in summaries]
    params = [p for p, _ in parsed]
    varying, fixed = _split_params(params, [k for _, k in parsed])
    ids = _job_ids(summaries)
    metrics = [_metrics(s) for s in summaries]

    ranked = [i for i, m in enumerate(metrics)  # a speed that may be ranked: >= 3 timed steps
              if m["status"] == OK and timed(m["tokens_per_s"], m["timed_steps"])]
    untimed = [ids[i] for i, m in enumerate(metrics) if m["status"] == OK and i not in ranked]
    spreads = {i: speed_spread(metrics[i]["tokens_per_s"], metrics[i]["tps_spread"],
                               assumed_spread) for i in ranked}
    candidates = [i for i in ranked
                  if metrics[i]["peak_MiB"] is not None and math.isfinite(metrics[i]["peak_MiB"])]
    front = pareto_front([(metrics[i]["peak_MiB"], metrics[i]["tokens_per_s"])
                          for i in candidates], [spreads[i][0] for i in candidates])
    on_front = {candidates[j] for j in front}
    unmeasured = [ids[i] for i in ranked if not spreads[i][1]]
    fastest = _fastest([ids[i] for i in ranked],
                       [(metrics[i]["tokens_per_s"], spreads[i][0]) for i in ranked])

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
    engine = [m[ENGINE_COLUMN] for m in metrics]
    if any(v is not None for v in engine):
        df.insert(list(df.columns).index("other_MiB") + 1, ENGINE_COLUMN,
                  pd.Series(engine, dtype="float64").to_numpy())
    after = "final_loss"
    for _, col in EVAL_COLUMNS:  # the held-out set's metrics, next to memory and speed
        values = [m[col] for m in metrics]
        if any(v is not None for v in values):
            df.insert(list(df.columns).index(after) + 1, col,
                      pd.Series(values, dtype="float64").to_numpy())
            after = col
    curves = {ids[i]: [float(v) for v in _get(s.get("train"), "loss_curve") or []]
              for i, s in enumerate(summaries) if metrics[i]["status"] == OK}
    df.attrs.update({"fixed": fixed, "params": varying, "failures": failures,
                     "untimed": untimed, "fastest": fastest,
                     "unmeasured": unmeasured, "assumed_spread": assumed_spread,
                     "loss_curves": {k: v for k, v in curves.items() if v}})
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
    A sort by speed (:data:`SPEED_COLUMNS`) puts the jobs that are not timed (``untimed``) with
    the blanks: their tokens/s is not ranked. Ties keep the job order. ``df.attrs`` is kept.
    """
    import pandas as pd

    col = resolve_column(df, column)
    values = df[col]
    if not pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
        numeric = pd.to_numeric(values, errors="coerce")
        if numeric.notna().sum() == values.notna().sum():
            values = numeric
    untimed = {str(j) for j in df.attrs.get("untimed") or []}
    if col in SPEED_COLUMNS and untimed:
        values = values.where(~df["job"].astype(str).isin(untimed))
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
