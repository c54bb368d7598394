"""The Hydra task: what ``memlab`` / ``python -m memlab`` runs for each job (one run, or every job
of a sweep). It reads Hydra's runtime (the run dir, the choices, the overrides, whether this is a
multirun) and runs the job: in this process (:func:`memlab.run.run`, which starts the ranks
itself for a multi-process run), or as one rank of a torchrun launch (:mod:`memlab.torchrun`),
with other libraries' warnings kept to the run's log (:func:`memlab.measure.runlog.quiet_libraries`).
A single run exits with the status's code (:func:`memlab.record.exit_code`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memlab import torchrun
from memlab.measure import runlog
from memlab.measure.console import printable
from memlab.measure.outcome import Interrupted
from memlab.measure.summary import user_choices
from memlab.record import exit_code, read_back
from memlab.run import run, with_record_id
from memlab.rundir import moved_note


def hydra_task(cfg: Any) -> dict[str, Any]:
    """The Hydra task function (called by ``memlab.__main__`` and by each sweep job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from memlab.distributed.base import external_launch  # (imports torch)

    hc = HydraConfig.get()
    choices = user_choices(hc.runtime.choices)
    multirun = hc.mode == RunMode.MULTIRUN
    job = {"name": hc.job.name, "num": hc.job.num if multirun else None,
           "sweep_dir": str(Path(hc.sweep.dir).resolve()) if multirun else None,
           "outputs": outputs_roots(hc)}
    moved = moved_note(hc.runtime.output_dir, hc.sweep.dir if multirun else None)
    if moved:
        job["moved"] = moved
    job = with_record_id(job)
    start = torchrun.run_rank if external_launch() else run
    with runlog.quiet_libraries():  # other libraries' warnings into memlab.log, counted
        runlog.file_only(printable(f"memlab run in {hc.runtime.output_dir}: "
                                   + " ".join(f"{k}={v}" for k, v in choices.items())))
        if hc.overrides.task:
            runlog.file_only(printable("overrides: " + " ".join(hc.overrides.task)))
        try:
            summary = start(cfg, Path(hc.runtime.output_dir), choices, list(hc.overrides.task),
                            job)
        except Interrupted as e:  # held while the record was written; the record is complete
            if multirun:
                return read_back(Path(hc.runtime.output_dir) / "summary.json",
                                 str(job["record_id"]))
            raise SystemExit(e.exit_code) from None
    if not multirun and summary["status"] != "ok":
        raise SystemExit(exit_code(summary))
    return summary


def outputs_roots(hc: Any) -> list[str]:
    """The outputs tree of this Hydra app, where ``train.resume_from=latest`` looks: the
    directory that holds ``hydra.run.dir`` and ``hydra.sweep.dir`` (their part before the first
    ``${...}``, up to its last ``/``): ``outputs/`` and ``multirun/`` by default; a fixed run dir
    ``runs/a`` -> ``runs/`` (a bare name: that directory)."""
    from omegaconf import OmegaConf

    roots = []
    for node in (hc.run, hc.sweep):
        spec = OmegaConf.to_container(node, resolve=False)
        fixed = str((spec.get("dir") if isinstance(spec, dict) else None) or "")
        fixed = fixed.split("${", 1)[0].rstrip("/")
        if not fixed:
            continue
        root = Path(fixed).parent if "/" in fixed else Path(fixed)
        if str(root.absolute()) not in roots:
            roots.append(str(root.absolute()))
    return roots
