"""Running one job: validate -> (resume plan) -> pipeline -> train -> summary.json.

:func:`run` checks the configuration (:func:`memlab.context.validate`), plans a resume, and
trains: in this process (:func:`execute`), or - with ``world_size > 1`` - on ranks it starts
itself (:func:`memlab.distributed.launch.launch`; each rank is ``python -m memlab.rank``, which
calls :func:`execute`) and whose records it merges. Whatever happens, the job ends in a written
record (:func:`memlab.record.guarded`). The other ways a job is started live beside this one:
:mod:`memlab.hydra_task` (each Hydra job) and :mod:`memlab.torchrun` (a rank of a torchrun
launch).
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

from memlab.context import BuildContext, plain_config, resolved_options, validate
from memlab.distributed import launch
from memlab.logger.base import RunInfo, build_logger
from memlab.measure import runlog
from memlab.measure.console import printable
from memlab.measure.schema import SCHEMA_VERSION
from memlab.measure.summary import device_info, format_table
from memlab.record import guarded
from memlab.rundir import held_descriptors

# torch-heavy modules (memlab.pipeline, memlab.distributed.base, memlab.measure.memory) are
# imported where they are used, so that `memlab --help` and tab completion start fast.


def plan_resume(ctx: BuildContext, summary: dict[str, Any]) -> BuildContext:
    """``train.resume_from`` checked against the checkpoint's recorded config before anything
    loads (:func:`memlab.trainer.resume.plan_resume`; ConfigErrors listing every refused
    difference), recorded in ``summary["resume"]``; ``latest`` becomes the directory found, in
    the context and in the config the ranks train from."""
    from memlab import rundir
    from memlab.trainer import resume

    def live(run_dir: Path) -> str | None:
        holder = rundir.in_use(run_dir)
        return None if holder is None else rundir.holder_words(holder)

    roots = [Path(r) for r in (summary.get("job") or {}).get("outputs") or []]
    plan = resume.plan_resume(ctx, roots, live=live)
    if plan is None:
        return ctx
    summary["resume"] = plan.as_dict()
    for skipped in plan.skipped:  # resume_from=latest passed over a newer damaged checkpoint,
        runlog.log.warning(f"[memlab] train.resume_from=latest: skipped "  # or a live run's
                           f"{skipped['checkpoint']}: {skipped['why']}")
    if plan.requested == "latest" and ctx.rank == 0:
        runlog.log.warning(f"[memlab] train.resume_from=latest: resuming {plan.path} "
                           f"(step {plan.step})")
    if isinstance(summary.get("config"), dict):
        summary["config"].setdefault("train", {})["resume_from"] = str(plan.path)
    return dataclasses.replace(ctx, train=dataclasses.replace(ctx.train,
                                                              resume_from=str(plan.path)))


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def base_summary(run_dir: Path, choices: dict[str, str], overrides: list[str],
                 job: dict[str, Any]) -> dict[str, Any]:
    """The record of a job before it runs (``job["moved"]``: its directory is a fallback for
    one that could not be written, :mod:`memlab.rundir`: the record says so from the start);
    its layout is :class:`memlab.measure.schema.Summary`."""
    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "status": "failed",
        "error": None,
        "choices": choices,
        "resolved": {},
        "overrides": overrides,
        "run_dir": str(run_dir),
        "job": with_record_id(job),
        "memory": None,
        "throughput": None,
        "data": None,
        "train": None,
        "versions": None,
        "device": None,
        "wall_time_s": None,
    }
    if (job or {}).get("moved"):
        summary["write_error"] = job["moved"]
    return summary


def with_record_id(job: dict[str, Any] | None) -> dict[str, Any]:
    """``job`` with its ``record_id``: the one it has, the launcher's (``$MEMLAB_RECORD_ID``), or
    a new random one (:data:`memlab.measure.summary.RECORD_ID_ENV`)."""
    import os
    import uuid

    from memlab.measure.summary import RECORD_ID_ENV

    job = dict(job or {})
    job.setdefault("record_id", os.environ.get(RECORD_ID_ENV) or uuid.uuid4().hex)
    return job


def run(cfg: Any, run_dir: Path | str, choices: dict[str, str] | None = None,
        overrides: list[str] | None = None, job: dict[str, Any] | None = None,
        print_table: bool = True) -> dict[str, Any]:
    """Run one job and write ``run_dir/summary.json``; returns the summary. Never raises for
    a failing job (the status says what happened)."""
    run_dir = Path(run_dir)
    choices = dict(choices or {})
    summary = base_summary(run_dir, choices, list(overrides or []), job or {})

    def body(logger_box: list) -> None:
        ctx = validate(cfg, run_dir, choices)
        summary["config"] = plain_config(cfg)
        summary["resolved"] = resolved_options(summary["config"], ctx)
        ctx = plan_resume(ctx, summary)
        if ctx.world_size > 1:  # one worker process per rank; their summaries merged here
            launch.launch(ctx, summary, worker="memlab.rank", keep=held_descriptors())
        else:
            execute(ctx, summary, logger_box)

    try:
        guarded(body, summary, run_dir / "summary.json",
                on_end=lambda s, box: late_logger(cfg, RunInfo(run_dir, choices, sweep_dir(job)),
                                                  s, box))
    finally:  # also when a stop signal held while the record was written is raised now
        if print_table:
            runlog.say(printable(format_table(summary), keep_newlines=True))
    return summary


class CheckpointNotWritten(RuntimeError):
    """A checkpoint the run was asked for could not be written (the training and its
    measurements are recorded all the same)."""


def logger_config(summary: dict[str, Any]) -> dict[str, Any]:
    """What a logger records as the run's configuration: the config, and the versions."""
    return {**(summary.get("config") or {}), "versions": summary.get("versions")}


def sweep_dir(job: dict[str, Any] | None) -> Path | None:
    sweep = (job or {}).get("sweep_dir")
    return Path(sweep) if sweep else None


def late_logger(cfg: Any, info: RunInfo, summary: dict[str, Any], logger_box: list) -> None:
    """A job that ended before its logger started (an invalid configuration, bad data, a
    launch that failed) starts it now, so that the logger records it too (a W&B sweep's
    dashboard shows every job, with its status and reason). Nothing when the logger option
    itself cannot be read or started (that is said on stderr)."""
    if logger_box or summary.get("logger"):
        return
    node = plain_config(cfg).get("logger")
    if not isinstance(node, dict):
        return
    option, errors = build_logger(dict(node))
    if option is None or errors:
        return
    config = {**plain_config(cfg), "versions": summary.get("versions")}
    try:
        logger = option.start(info, config)
    except Exception as e:  # noqa: BLE001 - the job's own record matters more
        runlog.log.warning(f"[memlab] logger={node.get('name')} could not record this "
                           f"{summary.get('status')} job: {type(e).__name__}: {e}")
        return
    logger_box.append(logger)
    summary["logger"] = logger.describe()


def execute(ctx: BuildContext, summary: dict[str, Any], logger_box: list) -> None:
    """Train in this process (one rank, or the only process) and fill ``summary``."""
    summary["device"] = device_info(ctx.device)
    seed_everything(ctx.train.seed)
    try:
        _train(ctx, summary, logger_box)
    finally:  # a one-rank wrapper that made its own process group (deepspeed) releases it
        if ctx.world_size == 1:
            ctx.distributed.teardown()


def _train(ctx: BuildContext, summary: dict[str, Any], logger_box: list) -> None:
    from memlab import pipeline

    logger = ctx.logger.start(RunInfo.of(ctx, summary["job"].get("sweep_dir")),
                              logger_config(summary))
    logger_box.append(logger)
    if ctx.rank == 0:
        summary["logger"] = logger.describe()
    pipe = pipeline.build(ctx, logger=logger,
                          on_data=lambda stats: summary.update(data=stats.as_dict()))
    trainer = pipe.trainer
    try:
        result = trainer.train()
        if ctx.train.save_final and trainer.saved_step != result.steps:
            trainer.try_save_checkpoint()  # (unless the loop saved this step already)
    finally:  # whatever happened, what was measured so far is recorded
        summary["memory"] = trainer.probe.result()
        if trainer.evaluator is not None and pipe.held_out is not None:
            summary["eval"] = trainer.evaluator.summary(pipe.held_out.describe())
        if pipe.generation is not None:
            engine = pipe.generation.engine.memory()
            if engine:  # what a vLLM engine holds outside the trainer's tensors
                summary["memory"]["generation_engine"] = engine
            pipe.generation.close()
        if pipe.offload is not None:
            summary["memory"]["offload"] = pipe.offload.stats()
        summary["memory"]["params"] = _param_counts(pipe.models["policy"])
        summary["memory"]["models"] = {role: _param_counts(m) for role, m in
                                       pipe.models.items()}
        wrapper = ctx.distributed.describe(pipe.models["policy"])
        if wrapper:
            summary["memory"]["distributed"] = wrapper
        record_training(summary, trainer.result, trainer.steps, trainer.plan.as_dict())
        note_hollow_groups(summary, trainer.result.counts, ctx.data.max_hollow_fraction,
                           ctx.rank == 0)
    if trainer.result.checkpoint_errors:
        raise CheckpointNotWritten(
            f"checkpoint not written ({trainer.result.checkpoint_errors[-1]}); the training "
            f"and its measurements are recorded")


def _finite(x: Any) -> Any:
    """``x``, or None for a NaN / infinite float (summary.json stays strict JSON)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def record_training(summary: dict[str, Any], result, planned_steps: int,
                    epochs: dict[str, int] | None = None) -> None:
    """What the loop measured (all of it, or the steps done so far) into ``summary``:
    throughput, tokens trained, padding, the loss curve and the other curves, and the newest
    checkpoint this run wrote (``result.checkpoints``; one an earlier run left in the same
    run dir is not this run's). ``epochs``: ``train.epochs`` and the steps a pass came to
    (:meth:`memlab.trainer.epochs.StepPlan.as_dict`)."""
    saved = list(result.checkpoints)
    summary["throughput"] = result.throughput()
    if summary.get("data") is not None:
        summary["data"]["padding_fraction"] = result.padding_fraction()
        summary["data"]["tokens_trained"] = result.real_tokens
    losses = [_finite(x) for x in result.losses]
    summary["train"] = {
        "final_loss": losses[-1] if losses else None,
        "steps": result.steps,
        "steps_planned": planned_steps,
        **(epochs or {}),
        "loss_curve": losses,
        "final_metrics": {k: _finite(v) for k, v in result.metrics.items()},
        "curves": {k: [_finite(x) for x in v] for k, v in result.curves.items()},
        "checkpoint": saved[-1] if saved else None,  # the newest this run wrote
    }
    if result.checkpoint_errors:
        summary["checkpoint"] = {"errors": list(result.checkpoint_errors)}
    if result.profile is not None:
        summary["profile"] = result.profile


def note_hollow_groups(summary: dict[str, Any], counts: dict[str, int], limit: float,
                       say: bool = True) -> None:
    """An online method's reward groups into the summary's ``data`` (``groups``,
    ``hollow_groups``: those whose rewards had zero variance, which train nothing), with a
    warning (``data.hollow_groups_warning``, on stderr when ``say``) when their share is above
    ``data.max_hollow_fraction``. A run whose every group was hollow stays ``ok``: its memory
    and speed were measured, and the warning says that it learned nothing."""
    groups = counts.get("groups")
    if not groups or summary.get("data") is None:
        return
    hollow = counts.get("hollow_groups", 0)
    summary["data"].update(groups=groups, hollow_groups=hollow)
    if hollow / groups <= limit:
        return
    warning = summary["data"]["hollow_groups_warning"] = (
        f"{hollow} of {groups} reward groups ({hollow / groups:.0%}) had rewards of zero "
        "variance: their advantages are zero, they train nothing"
        + ("; no group carried a signal: check the reward functions (or models) and the "
           "sampling (method.max_completion_length, temperature)" if hollow == groups else "")
        + f" (above data.max_hollow_fraction={limit:g})")
    if say:
        runlog.warn(warning)


def _param_counts(model) -> dict[str, int]:
    """Parameter counts and bytes of one model (the reference's cost shows here)."""
    params = list(model.parameters())
    return {
        "total": int(sum(p.numel() for p in params)),
        "trainable": int(sum(p.numel() for p in params if p.requires_grad)),
        "bytes": int(sum(p.numel() * p.element_size() for p in params)),
    }
