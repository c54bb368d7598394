"""``memlab report``, loading: find the ``summary.json`` of every job under the inputs, and a
record for every Hydra job dir that lacks one, or job of a sweep with no dir (``missing``), or
whose summary is unreadable or not a summary this memlab reads (``corrupt``, with why: not JSON,
a key or a type that the record's definition, :mod:`memlab.measure.schema`, does not have, a
``schema_version`` newer than this memlab's). A summary written before ``schema_version`` is
read as that layout. Reads JSON and YAML only."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from memlab.measure.schema import Unreadable, read
from memlab.measure.summary import user_choices

SUMMARY_NAME = "summary.json"
"""File name of the per-job summary written by a run."""

OVERRIDES_REL = Path(".hydra") / "overrides.yaml"
HYDRA_REL = Path(".hydra") / "hydra.yaml"

MULTIRUN_NAME = "multirun.yaml"
"""Hydra's record of a sweep, in its sweep dir."""

PROFILE_DIR = re.compile(r"profile(_rank\d+)?")
"""A run's profiler output (beside its summary.json), not a job."""

OK = "ok"
MISSING = "missing"
RUNNING = "running"
"""A job without a summary whose dir a live process holds (:func:`memlab.rundir.in_use`): not
dead, still running."""
CORRUPT = "corrupt"


def _natural_key(name: str) -> list[Any]:
    """Sort key putting ``2`` before ``10`` (Hydra job dirs are numbered)."""
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", name)]


def _discover(root: Path) -> Iterator[Path]:
    """Yield every ``summary.json`` under ``root`` and every Hydra job dir that lacks one.

    Hidden dirs (``.hydra``, ``.git`` ...) are not descended into, nor a run's ``profile/`` and
    ``profile_rank<r>/`` (the profiler's own ``summary.json``: :mod:`memlab.measure.profile`).
    The order is a natural sort of the paths, so the jobs of a sweep come out as
    ``0, 1, 2, ..., 10``.
    """
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted((d for d in dirnames if not d.startswith(".")), key=_natural_key)
        here = Path(dirpath)
        if SUMMARY_NAME in filenames:
            dirnames[:] = [d for d in dirnames if not PROFILE_DIR.fullmatch(d)]
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
    return user_choices(choices)


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


def _no_summary(job_dir: Path, why: str) -> dict[str, Any]:
    """The record of a job dir without a summary: ``running`` when a live process holds the
    dir's lock (the job runs still), else ``missing`` for ``why``."""
    from memlab.rundir import holder_words, in_use

    holder = in_use(job_dir) if job_dir.is_dir() else None
    if holder is not None:
        return _placeholder(job_dir, RUNNING, f"running ({holder_words(holder)}); no "
                                              f"{SUMMARY_NAME} yet", job_dir)
    return _placeholder(job_dir, MISSING, why, job_dir)


def sweep_plan(sweep_dir: Path) -> dict[int, list[str]] | None:
    """Job number -> overrides of every job of the sweep whose ``multirun.yaml`` is in
    ``sweep_dir``, expanded as Hydra's basic sweeper expands it (the sweeper's ``params``, then
    the command line's overrides); None when that cannot be known (another sweeper, job dirs
    not named by their number, a sweep that needs the configs to expand: ``glob(...)``)."""
    data = _read_yaml(sweep_dir / MULTIRUN_NAME)
    try:
        hydra = data["hydra"]
        sweeper = hydra["runtime"]["choices"].get("hydra/sweeper")
        task = [str(o) for o in hydra["overrides"]["task"]]
        params = hydra["sweeper"].get("params") or {}
        subdir = str(hydra["sweep"]["subdir"])
    except (TypeError, KeyError, AttributeError):
        return None
    if sweeper != "basic" or subdir != "${hydra.job.num}":
        return None
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(
            [f"{k}={v}" for k, v in params.items()] + task)
        jobs = BasicSweeper.split_arguments(parsed, None)[0]
    except Exception:  # noqa: BLE001 - a sweep this cannot expand: its jobs are not guessed
        return None
    return dict(enumerate(jobs))


def _unrecorded(sweep_dir: Path, seen: set[Path]) -> list[dict[str, Any]]:
    """A ``missing`` record, with its overrides, for every job of the sweep in ``sweep_dir``
    (:func:`sweep_plan`) whose dir holds neither a summary nor Hydra's record of the job, or
    does not exist (the job never started, or its dir was removed)."""
    plan = sweep_plan(sweep_dir) or {}
    out = []
    for num, overrides in plan.items():
        job_dir = sweep_dir / str(num)
        if job_dir.resolve() in seen:
            continue
        why = ("no job dir (the job never started, or its dir was removed)"
               if not job_dir.is_dir() else
               f"no {SUMMARY_NAME} and no Hydra record (.hydra/) in the job dir (the job died "
               "before writing them; see its log)")
        record = _no_summary(job_dir, why)
        record["overrides"] = overrides
        record["job"]["sweep_dir"] = str(sweep_dir)
        out.append(record)
    return out


def _load_file(path: Path) -> dict[str, Any]:
    """Load one ``summary.json``, in today's layout (:func:`memlab.measure.schema.read`); one
    that cannot be read, or is not a summary this memlab reads, becomes a ``corrupt`` record
    naming why."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"top level is a JSON {type(data).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        return _placeholder(path.parent, CORRUPT, f"unreadable {path}: {exc}", path)
    try:
        data = read(data)
    except Unreadable as exc:
        return _placeholder(path.parent, CORRUPT, f"not a summary this memlab reads: {path}: "
                                                  f"{exc}", path)
    data["_path"] = str(path)
    data["_dir"] = str(path.parent)
    return data


def load_summaries(paths: Sequence[Path | str]) -> list[dict[str, Any]]:
    """Load the summaries of every job found under ``paths``.

    Each path may be a multirun dir (walked recursively for ``summary.json``), a run dir, or a
    ``summary.json`` file. A Hydra job dir (one with ``.hydra/overrides.yaml``) without a summary
    yields a record with status ``"missing"`` and the overrides read from that file, and so does
    every job of a sweep (a dir with Hydra's ``multirun.yaml``) whose dir holds neither or does
    not exist (its overrides from the sweep: :func:`sweep_plan`); a summary
    that is not valid JSON, or not a summary this memlab reads (:func:`_load_file`), yields
    status ``"corrupt"`` with the path and why in ``error``. Every record
    gets ``_path`` (the summary file, or the job dir when missing) and ``_dir`` (the job dir).
    The same job reached through two inputs is returned once.

    Raises:
        FileNotFoundError: if one of ``paths`` does not exist.
    """
    records: list[dict[str, Any]] = []
    seen: set[Path] = set()
    job_dirs: set[Path] = set()
    sweeps: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            found: list[Path] = [path]
        elif path.is_dir():
            found = list(_discover(path))
            sweeps += [Path(d) for d, names, files in os.walk(path)
                       if MULTIRUN_NAME in files and not any(
                           p.startswith(".") for p in Path(d).relative_to(path).parts)]
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")
        for item in found:
            key = item.resolve()
            if key in seen:
                continue
            seen.add(key)
            job_dirs.add(key if item.is_dir() else key.parent)
            if item.is_dir():
                msg = f"no {SUMMARY_NAME} (the job died before writing it; see its log)"
                records.append(_no_summary(item, msg))
            else:
                records.append(_load_file(item))
    for sweep in dict.fromkeys(s.resolve() for s in sweeps):
        for record in _unrecorded(sweep, job_dirs):
            job_dirs.add(Path(record["_dir"]).resolve())
            records.append(record)
    return records

