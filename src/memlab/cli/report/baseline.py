"""``memlab report --baseline``: what each job saves and costs against one job of the sweep.

The baseline is a job id (the ``job`` column: Hydra's job number, or the job dir's name) or the
overrides that exactly one job has together (``peft=none``, or ``peft=none
train.gradient_checkpointing=true`` where more than one setting varies; a key of a varying
parameter, or its last dotted part). A baseline that names no job, or several, is refused with
the exact ``--baseline`` that names one. Each job then gets the change of its peak
memory (MiB and percent) and of each memory category (MiB), and of its tokens/s (percent)
against the baseline's; the baseline's own row reads 0, a job that is not ok (or the baseline,
when it is not) reads blank. A tokens/s change needs both jobs timed (at least three timed
steps, :mod:`memlab.measure.speed`): otherwise it reads "not timed". Whether a tokens/s change
is larger than the larger of the two jobs' spreads is said under the table: a change inside it
is not a measured difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from memlab.cli.report.load import OK
from memlab.cli.report.table import ASSUMED_SPREAD, CATEGORIES, DELTA_COLUMNS, speed_spread
from memlab.measure.speed import tied

if TYPE_CHECKING:
    import pandas as pd


class BaselineError(ValueError):
    """``--baseline`` names no job, or several (the message gives the exact ``--baseline`` that
    names one)."""


def _items(baseline: str | Sequence[str]) -> list[str]:
    return [baseline] if isinstance(baseline, str) else [str(b) for b in baseline]


def _column(key: str, params: list[str]) -> str | None:
    """The varying parameter ``key`` names: itself, or the one whose last dotted part it is."""
    if key in params:
        return key
    named = [p for p in params if p.rsplit(".", 1)[-1] == key]
    return named[0] if len(named) == 1 else None


def _naming(df: pd.DataFrame, i: int, params: list[str]) -> str:
    """``--baseline ...`` that names row ``i``: every varying parameter's value (quoted for a
    shell), or the job id where those do not tell it from another job."""
    import shlex

    pairs = [(p, df[p][i]) for p in params if df[p][i] is not None and df[p][i] == df[p][i]]
    same = [j for j in range(len(df))
            if all(str(df[p][j]) == str(v) for p, v in pairs)]
    if pairs and same == [i]:
        return "--baseline " + " ".join(shlex.quote(f"{p}={v}") for p, v in pairs)
    return f"--baseline {df['job'][i]}"


def find_baseline(df: pd.DataFrame, baseline: str | Sequence[str]) -> int:
    """The row of ``df`` that ``baseline`` names: a job id (the ``job`` column), or one or more
    ``key=value`` overrides that exactly one job has together (``key``: a varying parameter, or
    its last dotted part; a fixed parameter at its value is no constraint)."""
    items = _items(baseline)
    jobs = [str(j) for j in df["job"]]
    params = [str(p) for p in df.attrs.get("params") or []]
    fixed = df.attrs.get("fixed") or {}
    said = " ".join(items)
    syntax = (f"give a job id (--baseline {jobs[0]}; the job column) or what varies as key=value "
              "pairs, several at once" + (f" (e.g. {_naming(df, 0, params)})" if params
                                         else ""))
    if len(items) == 1 and "=" not in items[0]:
        if items[0] in jobs:
            return jobs.index(items[0])
        raise BaselineError(f"--baseline {said}: no job is {said!r}; {syntax}; jobs: "
                            f"{', '.join(jobs)}")
    rows = list(range(len(df)))
    for item in items:
        key, sep, value = item.partition("=")
        key = key.lstrip("+")
        if not sep or not key:
            raise BaselineError(f"--baseline {said}: {item!r} is not key=value (a job id stands "
                                f"alone); {syntax}")
        column = _column(key, params)
        if column is not None:
            rows = [i for i in rows if str(df[column][i]) == value]
        elif key in fixed and str(fixed[key]) == value:
            continue  # every job has it
        elif key in fixed:
            raise BaselineError(f"--baseline {said}: every job has {key}={fixed[key]}; name a "
                                f"parameter that varies; {syntax}")
        else:
            varying = "; ".join(f"{p}: {', '.join(sorted({str(v) for v in df[p]}))}"
                                for p in params)
            raise BaselineError(f"--baseline {said}: {key} is not a parameter that varies "
                                f"({varying or 'none varies'}); {syntax}")
    if len(rows) == 1:
        return rows[0]
    if not rows:
        varying = "; ".join(f"{p}: {', '.join(sorted({str(v) for v in df[p]}))}"
                            for p in params)
        raise BaselineError(f"--baseline {said}: no job is {said!r}; {syntax}"
                            + (f"; what varies: {varying}" if varying else ""))
    options = [f"{_naming(df, i, params)} (job {jobs[i]})" for i in rows[:3]]
    raise BaselineError(
        f"--baseline {said}: {len(rows)} jobs have it (jobs {', '.join(jobs[i] for i in rows)});"
        f" name one: {', or '.join(options)}" + (", ..." if len(rows) > 3 else ""))


def _pct(new: Any, old: Any) -> float | None:
    if new is None or old is None or old != old or new != new or not old:
        return None
    return 100.0 * (float(new) - float(old)) / float(old)


def add_baseline(df: pd.DataFrame, baseline: str | Sequence[str]) -> pd.DataFrame:
    """``df`` with :data:`DELTA_COLUMNS` against the job ``baseline`` names, and
    ``df.attrs["baseline"]`` (``{"job", "label", "noisy", "untimed", "notes"}``: ``noisy``, the
    jobs whose tokens/s change is within the larger of the two jobs' spreads; ``untimed``, the
    ok jobs whose change reads "not timed", as this job or the baseline is not timed, and whose
    ``d_tokens_per_s_pct`` is blank). Raises :class:`BaselineError`."""
    import pandas as pd

    b = find_baseline(df, baseline)
    base = df.loc[b]
    ok_base = base["status"] == OK
    rows: dict[str, list[float | None]] = {c: [] for c in DELTA_COLUMNS}
    noisy, untimed = [], []
    not_timed = {str(j) for j in df.attrs.get("untimed") or []}
    assumed = float(df.attrs.get("assumed_spread", ASSUMED_SPREAD))
    base_timed = str(base["job"]) not in not_timed
    for i in range(len(df)):
        row = df.loc[i]
        ok = ok_base and row["status"] == OK

        def diff(col: str, row=row, ok=ok) -> float | None:
            new, old = row[col], base[col]
            return float(new) - float(old) if ok and new == new and old == old else None

        rows["d_peak_MiB"].append(diff("peak_MiB"))
        rows["d_peak_pct"].append(_pct(row["peak_MiB"], base["peak_MiB"]) if ok else None)
        for _, col in CATEGORIES:
            rows[f"d_{col}"].append(diff(col))
        both = ok and base_timed and str(row["job"]) not in not_timed
        if ok and not both:
            untimed.append(str(row["job"]))
        tps = _pct(row["tokens_per_s"], base["tokens_per_s"]) if both else None
        rows["d_tokens_per_s_pct"].append(tps)
        if tps is not None and i != b:
            new, old = float(row["tokens_per_s"]), float(base["tokens_per_s"])
            if tied(new, speed_spread(new, row["tps_spread"], assumed)[0],
                    old, speed_spread(old, base["tps_spread"], assumed)[0]):
                noisy.append(str(row["job"]))
    out = df.copy()
    at = list(out.columns).index("pareto") + 1
    for k, col in enumerate(DELTA_COLUMNS):
        out.insert(at + k, col, pd.Series(rows[col], dtype="float64").to_numpy())
    out.attrs = dict(df.attrs)
    items = _items(baseline)
    label = " ".join(items) if "=" in items[0] else f"job {items[0]}"
    out.attrs["baseline"] = {"job": str(base["job"]), "label": label, "noisy": noisy,
                             "untimed": untimed,
                             "notes": _notes(str(base["job"]), label, noisy, ok_base,
                                             base_timed)}
    return out


def _notes(job: str, label: str, noisy: list[str], ok: bool, timed: bool) -> list[str]:
    """What the change columns mean (printed under the table)."""
    named = f"job {job}" + (f" ({label})" if "=" in label else "")
    out = [f"d_*: change against the baseline, {named}: peak memory and each "
           "category in MiB (negative: a saving), peak and tokens/s in percent (positive: "
           "faster)"]
    if not ok:
        out.append(f"! the baseline, job {job}, is not ok: no change can be computed")
    elif not timed:
        out.append(f"! the baseline, job {job}, is not timed: no tokens/s change is ranked "
                   "against it (d_tokens_per_s_pct: not timed)")
    if noisy:
        out.append(f"~ job(s) {', '.join(noisy)}: the tokens/s change is within the larger of "
                   "the two jobs' spreads (tps_spread), not a measured difference")
    return out
