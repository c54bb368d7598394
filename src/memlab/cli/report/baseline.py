"""``memlab report --baseline``: what each job saves and costs against one job of the sweep.

The baseline is a job id (the ``job`` column: Hydra's job number, or the job dir's name) or an
override that exactly one job has (``peft=none``, ``train.gradient_checkpointing=true``; a key
of a varying parameter, or its last dotted part). Each job then gets the change of its peak
memory (MiB and percent) and of each memory category (MiB), and of its tokens/s (percent)
against the baseline's; the baseline's own row reads 0, a job that is not ok (or the baseline,
when it is not) reads blank. Whether a tokens/s change is larger than the jobs' measured spread
is said under the table: a change inside the spread is not a measured difference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memlab.cli.report.load import OK
from memlab.cli.report.table import CATEGORIES, DELTA_COLUMNS

if TYPE_CHECKING:
    import pandas as pd


class BaselineError(ValueError):
    """``--baseline`` names no job, or several (the message lists what it can name)."""


def find_baseline(df: pd.DataFrame, baseline: str) -> int:
    """The row of ``df`` that ``baseline`` names (module docstring)."""
    jobs = [str(j) for j in df["job"]]
    if baseline in jobs:
        return jobs.index(baseline)
    key, sep, value = baseline.partition("=")
    params = [str(p) for p in df.attrs.get("params") or []]
    fixed = df.attrs.get("fixed") or {}
    if sep:
        key = key.lstrip("+")
        column = key if key in params else next(
            (p for p in params if p.rsplit(".", 1)[-1] == key), None)
        if column is not None:
            rows = [i for i, v in enumerate(df[column]) if str(v) == value]
            if len(rows) == 1:
                return rows[0]
            if len(rows) > 1:
                raise BaselineError(
                    f"--baseline {baseline}: {len(rows)} jobs have it (jobs "
                    f"{', '.join(jobs[i] for i in rows)}); name one job, or add what else "
                    f"varies ({', '.join(p for p in params if p != column)})")
        elif key in fixed:
            raise BaselineError(f"--baseline {baseline}: every job has {key}={fixed[key]}; "
                                "name a parameter that varies")
    varying = "; ".join(f"{p}: {', '.join(sorted({str(v) for v in df[p]}))}" for p in params)
    raise BaselineError(f"--baseline {baseline}: no job is {baseline!r}; give a job "
                        f"({', '.join(jobs)}) or key=value of what varies"
                        + (f" ({varying})" if varying else ""))


def _pct(new: Any, old: Any) -> float | None:
    if new is None or old is None or old != old or new != new or not old:
        return None
    return 100.0 * (float(new) - float(old)) / float(old)


def add_baseline(df: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """``df`` with :data:`DELTA_COLUMNS` against the job ``baseline`` names, and
    ``df.attrs["baseline"]`` (``{"job", "label", "noisy"}``: the jobs whose tokens/s change
    is within the larger of the two jobs' spreads). Raises :class:`BaselineError`."""
    import pandas as pd

    b = find_baseline(df, baseline)
    base = df.loc[b]
    ok_base = base["status"] == OK
    rows: dict[str, list[float | None]] = {c: [] for c in DELTA_COLUMNS}
    noisy = []
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
        tps = _pct(row["tokens_per_s"], base["tokens_per_s"]) if ok else None
        rows["d_tokens_per_s_pct"].append(tps)
        if tps is not None and i != b:
            spread = max(float(s) if s == s else 0.0
                         for s in (row["tps_spread"], base["tps_spread"]))
            if abs(float(row["tokens_per_s"]) - float(base["tokens_per_s"])) <= spread:
                noisy.append(str(row["job"]))
    out = df.copy()
    at = list(out.columns).index("pareto") + 1
    for k, col in enumerate(DELTA_COLUMNS):
        out.insert(at + k, col, pd.Series(rows[col], dtype="float64").to_numpy())
    out.attrs = dict(df.attrs)
    label = baseline if "=" in baseline else f"job {baseline}"
    out.attrs["baseline"] = {"job": str(base["job"]), "label": label, "noisy": noisy,
                             "notes": _notes(str(base["job"]), label, noisy, ok_base)}
    return out


def _notes(job: str, label: str, noisy: list[str], ok: bool) -> list[str]:
    """What the change columns mean (printed under the table)."""
    named = f"job {job}" + (f" ({label})" if "=" in label else "")
    out = [f"d_*: change against the baseline, {named}: peak memory and each "
           "category in MiB (negative: a saving), peak and tokens/s in percent (positive: "
           "faster)"]
    if not ok:
        out.append(f"! the baseline, job {job}, is not ok: no change can be computed")
    if noisy:
        out.append(f"~ job(s) {', '.join(noisy)}: the tokens/s change is within the larger of "
                   "the two jobs' spreads (tps_spread), not a measured difference")
    return out
