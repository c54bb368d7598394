"""validate -> pipeline -> train -> summary. Every way a run ends (ok, invalid, oom, nan, failed,
interrupted: :mod:`memlab.measure.outcome`) ends in an atomically written summary.json holding
everything measured so far (the loss curve of the steps done, the memory of the tracked steps,
tokens/s, the data's stats); when the run dir cannot be written, the summary goes to a fallback
path that the run prints and records (:func:`memlab.measure.summary.write_summary`).

A run of several processes is started here too: with ``world_size > 1`` this process starts
the ranks (``memlab.distributed.launch``; each rank is ``python -m memlab.rank``) and merges
their records; under an external launcher (torchrun) every process is a rank already
(:func:`run_external`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from memlab import faults
from memlab.config import BuildContext, MeasureConfig, Platform, TrainConfig
from memlab.data.base import DataError
from memlab.distributed import launch
from memlab.logger.base import RunInfo
from memlab.measure.outcome import Interrupted, NonFiniteLoss, StopSignals
from memlab.measure.summary import (
    device_info,
    format_table,
    user_choices,
    versions,
    write_summary,
)
from memlab.registry import GROUPS, ConfigErrors, build, from_mapping

# torch-heavy modules (memlab.pipeline, memlab.distributed.base, memlab.measure.memory) are
# imported where they are used, so that `memlab --help` and tab completion start fast.

TOP_LEVEL = set(GROUPS) | {"train", "measure"}


def _plain(cfg) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def resolve_device(requested: str, platform: Platform) -> str:
    if requested == "auto":
        return "cuda" if platform.cuda else "cpu"
    return requested


def validate(cfg, run_dir: Path | str = ".", choices: dict[str, str] | None = None,
             world_size: int | None = None, rank: int = 0,
             platform: Platform | None = None) -> BuildContext:
    """Every group node -> typed config, then every cross-group rule. Raises ConfigErrors with
    all problems at once. Loads no model and no data. ``world_size`` None: the processes the
    distributed option asks for; ``platform`` None: this machine."""
    data = _plain(cfg)
    errors: list[str] = []
    typed: dict[str, Any] = {}
    for key in sorted(set(data) - TOP_LEVEL):
        errors.append(f"unknown top-level key {key!r} (valid: {', '.join(sorted(TOP_LEVEL))})")
    # a value of the wrong type or out of range is reported and replaced by its default, so that
    # the checks below still run: every problem is reported at once
    for group in GROUPS:
        node = data.get(group)
        if not isinstance(node, dict):
            errors.append(f"{group}: missing config group (add '{group}: <option>' to defaults)")
            continue
        obj, errs = build(group, node, partial=True)
        errors += errs
        typed[group] = obj
    train, errs = from_mapping(TrainConfig, data.get("train") or {}, "train", partial=True)
    errors += errs
    measure, errs = from_mapping(MeasureConfig, data.get("measure") or {}, "measure",
                                 partial=True)
    errors += errs
    if train is None or measure is None or any(typed.get(g) is None for g in GROUPS):
        raise ConfigErrors(errors)  # an unknown option: the cross-group rules cannot run
    platform = platform or Platform.detect()
    device = resolve_device(train.device, platform)
    if device == "cuda" and not platform.cuda:
        errors.append("train.device=cuda but no CUDA device is visible; use train.device=auto")
    if len(train.betas) != 2:
        errors.append(f"train.betas must be two numbers [beta1, beta2] (got {train.betas})")
    if world_size is None:
        world_size = typed["distributed"].processes(device, platform.gpus)
    ctx = BuildContext(
        **typed, train=train, measure=measure, device=device, world_size=world_size,
        rank=rank, choices=dict(choices or {}), run_dir=Path(run_dir), platform=platform,
    )
    for group in GROUPS:
        errors += typed[group].validate(ctx)
    errors += train.checkpoint_errors(ctx)
    errors += train.eval_errors(ctx)
    errors += measure.errors(train)
    if errors:
        raise ConfigErrors(errors)
    return ctx


def plan_resume(ctx: BuildContext, summary: dict[str, Any]) -> BuildContext:
    """``train.resume_from`` checked against the checkpoint's recorded config before anything
    loads (:func:`memlab.trainer.checkpoint.plan_resume`; ConfigErrors listing every refused
    difference), recorded in ``summary["resume"]``; ``latest`` becomes the directory found, in
    the context and in the config the ranks train from."""
    from memlab.trainer import checkpoint

    roots = [Path(r) for r in (summary.get("job") or {}).get("outputs") or []]
    plan = checkpoint.plan_resume(ctx, roots)
    if plan is None:
        return ctx
    summary["resume"] = plan.as_dict()
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
    return {
        "status": "failed",
        "error": None,
        "choices": choices,
        "overrides": overrides,
        "run_dir": str(run_dir),
        "job": job,
        "memory": None,
        "throughput": None,
        "data": None,
        "train": None,
        "versions": None,
        "device": None,
        "wall_time_s": None,
    }


def run(cfg, run_dir: Path | str, choices: dict[str, str] | None = None,
        overrides: list[str] | None = None, job: dict[str, Any] | None = None,
        print_table: bool = True) -> dict[str, Any]:
    """Run one job and write ``run_dir/summary.json``; returns the summary. Never raises for
    a failing job (the status says what happened)."""
    from memlab.distributed.base import external_launch

    if external_launch():  # one rank of a torchrun launch: the ranks meet in rank 0's run dir
        return run_external(cfg, Path(run_dir), dict(choices or {}), list(overrides or []),
                            job or {}, print_table)
    run_dir = Path(run_dir)
    choices = dict(choices or {})
    summary = base_summary(run_dir, choices, list(overrides or []), job or {})

    def body(logger_box: list) -> None:
        ctx = validate(cfg, run_dir, choices)
        summary["config"] = _plain(cfg)
        ctx = plan_resume(ctx, summary)
        if ctx.world_size > 1:  # one worker process per rank; their summaries merged here
            launch.launch(ctx, summary, worker="memlab.rank")
        else:
            execute(ctx, summary, logger_box)

    try:
        guarded(body, summary, run_dir / "summary.json",
                on_end=lambda s, box: late_logger(cfg, RunInfo(run_dir, choices, _sweep(job)),
                                                  s, box))
    finally:  # also when a stop signal held while the record was written is raised now
        if print_table:
            print(format_table(summary), flush=True)
    return summary


class CheckpointNotWritten(RuntimeError):
    """A checkpoint the run was asked for could not be written (the training and its
    measurements are recorded all the same)."""


def logger_config(summary: dict[str, Any]) -> dict[str, Any]:
    """What a logger records as the run's configuration: the config, and the versions."""
    return {**(summary.get("config") or {}), "versions": summary.get("versions")}


def _sweep(job: dict[str, Any] | None) -> Path | None:
    sweep = (job or {}).get("sweep_dir")
    return Path(sweep) if sweep else None


def late_logger(cfg, info: RunInfo, summary: dict[str, Any], logger_box: list) -> None:
    """A job that ended before its logger started (an invalid configuration, bad data, a
    launch that failed) starts it now, so that the logger records it too (a W&B sweep's
    dashboard shows every job, with its status and reason). Nothing when the logger option
    itself cannot be read or started (that is said on stderr)."""
    if logger_box or summary.get("logger"):
        return
    node = _plain(cfg).get("logger")
    if not isinstance(node, dict):
        return
    option, errors = build("logger", dict(node))
    if option is None or errors:
        return
    config = {**_plain(cfg), "versions": summary.get("versions")}
    try:
        logger = option.start(info, config)
    except Exception as e:  # noqa: BLE001 - the job's own record matters more
        print(f"[memlab] logger={node.get('name')} could not record this "
              f"{summary.get('status')} job: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        return
    logger_box.append(logger)
    summary["logger"] = logger.describe()


def guarded(body, summary: dict[str, Any], out: Path, on_end=None) -> dict[str, Any]:
    """Run ``body(logger_box)``, record how it ended in ``summary`` (:func:`record_end`) and
    write it to ``out`` (or to a fallback path, named in ``summary["write_error"]`` and printed,
    when ``out``'s dir cannot be written); ``on_end(summary, logger_box)`` runs before the
    record is written (:func:`late_logger`). Never raises for a failing job; SIGINT / SIGTERM stop
    the body (status ``interrupted``). A stop signal that arrives while the record is made is
    held until it is written and then raised (:class:`Interrupted`); so is any failure under
    ``MEMLAB_RAISE=1`` (debugging)."""
    t0 = time.perf_counter()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # recorded when the summary cannot be written there
    logger_box: list = []
    ended: BaseException | None = None
    with StopSignals() as stop:
        try:
            with stop.live():
                summary["versions"] = versions()
                body(logger_box)
        except BaseException as e:  # noqa: BLE001 - recorded below, never swallowed silently
            ended = e
        # from here on a stop signal waits: the record is written whole
        record_end(summary, ended)
        if on_end is not None and summary["status"] != "ok":
            on_end(summary, logger_box)
        if ended is not None and summary["status"] in ("failed", "oom", "nan"):
            _write_traceback(out, ended)
        faults.reach("summary")
        summary["wall_time_s"] = time.perf_counter() - t0
        try:
            _, why = write_summary(out, summary)
            if why:
                print(f"[memlab] {why}", file=sys.stderr, flush=True)
        except OSError as e:
            print(f"[memlab] could not write {out} nor any fallback ({e}); the summary is "
                  "only printed", file=sys.stderr, flush=True)
        if logger_box:
            try:
                logger_box[0].finish(summary)
            except Exception as e:  # noqa: BLE001
                print(f"[memlab] logger.finish failed: {e}")
    if stop.held is not None and summary["status"] != "interrupted":
        raise stop.held
    if ended is not None and os.environ.get("MEMLAB_RAISE") and summary["status"] != "ok":
        raise ended
    return summary


def record_end(summary: dict[str, Any], ended: BaseException | None) -> None:
    """Set ``summary["status"]`` and ``["error"]`` from how the body ended (``None``: it
    returned): invalid configuration or data, a stop signal (with ``signal``), a non-finite
    loss (``train.nan_step``), a failed rank (that rank's status), out of memory, or failed."""
    from memlab.distributed.launch import RankFailed

    if ended is None:
        summary["status"], summary["error"] = "ok", None
        return
    e = ended
    if isinstance(e, (ConfigErrors, DataError)):
        status, error = "invalid", str(e)
    elif isinstance(e, (Interrupted, KeyboardInterrupt)):
        sig = e.signal if isinstance(e, Interrupted) else "SIGINT"
        steps = (summary.get("train") or {}).get("steps")
        status = "interrupted"
        error = f"interrupted by {sig}" + (f" after {steps} step(s)" if steps is not None
                                           else " before training started")
        summary["signal"] = sig
    elif isinstance(e, NonFiniteLoss):
        status, error = "nan", str(e)
        if summary.get("train") is not None:
            summary["train"]["nan_step"] = e.step
    elif isinstance(e, RankFailed):
        status, error = e.status, f"{type(e).__name__}: {e}"
        if e.signal:
            summary["signal"] = e.signal
    else:
        from memlab.measure.memory import is_oom

        status = "oom" if is_oom(e) else "failed"
        error = f"{type(e).__name__}: {e}"
    summary["status"], summary["error"] = status, error


def _write_traceback(out: Path, e: BaseException) -> None:
    """The failure's traceback beside the summary (skipped when that dir cannot be written)."""
    name = "error.txt" if out.name == "summary.json" else f"{out.stem}.error.txt"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        (out.parent / name).write_text("".join(traceback.format_exception(e)))
    except OSError:
        pass


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
        record_training(summary, trainer.result, ctx.train.steps,
                        Path(ctx.run_dir) / "checkpoints")
    if trainer.result.checkpoint_errors:
        raise CheckpointNotWritten(
            f"checkpoint not written ({trainer.result.checkpoint_errors[-1]}); the training "
            f"and its measurements are recorded")


def _finite(x: Any) -> Any:
    """``x``, or None for a NaN / infinite float (summary.json stays strict JSON)."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def record_training(summary: dict[str, Any], result, planned_steps: int,
                    checkpoints: Path | None = None) -> None:
    """What the loop measured (all of it, or the steps done so far) into ``summary``:
    throughput, tokens trained, padding, the loss curve and the other curves, and the newest
    checkpoint under ``checkpoints``."""
    from memlab.trainer.checkpoint import step_dirs

    saved = step_dirs(checkpoints) if checkpoints is not None else []
    summary["throughput"] = result.throughput()
    if summary.get("data") is not None:
        summary["data"]["padding_fraction"] = result.padding_fraction()
        summary["data"]["tokens_trained"] = result.real_tokens
    losses = [_finite(x) for x in result.losses]
    summary["train"] = {
        "final_loss": losses[-1] if losses else None,
        "steps": result.steps,
        "steps_planned": planned_steps,
        "loss_curve": losses,
        "final_metrics": {k: _finite(v) for k, v in result.metrics.items()},
        "curves": {k: [_finite(x) for x in v] for k, v in result.curves.items()},
        "checkpoint": str(saved[-1]) if saved else None,  # the newest of this run dir
    }
    if result.checkpoint_errors:
        summary["checkpoint"] = {"errors": list(result.checkpoint_errors)}
    if result.profile is not None:
        summary["profile"] = result.profile


def _param_counts(model) -> dict[str, int]:
    """Parameter counts and bytes of one model (the reference's cost shows here)."""
    params = list(model.parameters())
    return {
        "total": int(sum(p.numel() for p in params)),
        "trainable": int(sum(p.numel() for p in params if p.requires_grad)),
        "bytes": int(sum(p.numel() * p.element_size() for p in params)),
    }


def hydra_task(cfg) -> dict[str, Any]:
    """The Hydra task function (called by ``memlab.__main__`` and by each sweep job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    choices = user_choices(hc.runtime.choices)
    multirun = hc.mode == RunMode.MULTIRUN
    job = {"name": hc.job.name, "num": hc.job.num if multirun else None,
           "sweep_dir": str(Path(hc.sweep.dir).resolve()) if multirun else None,
           "outputs": outputs_roots(hc)}
    try:
        summary = run(cfg, hc.runtime.output_dir, choices, list(hc.overrides.task), job)
    except Interrupted as e:  # held while the record was written; the record is complete
        if multirun:
            return read_back(Path(hc.runtime.output_dir) / "summary.json")
        raise SystemExit(e.exit_code) from None
    if not multirun and summary["status"] != "ok":
        raise SystemExit(exit_code(summary))
    return summary


def exit_code(summary: dict[str, Any]) -> int:
    """A single run's exit status: 0 ok, 2 invalid, 128 + the signal when interrupted (130 for
    Ctrl-C, 143 for SIGTERM), 1 otherwise."""
    import signal

    status = summary.get("status")
    if status == "ok":
        return 0
    if status == "invalid":
        return 2
    if status == "interrupted":
        return 128 + int(getattr(signal, summary.get("signal") or "SIGINT", signal.SIGINT))
    return 1


def read_back(path: Path) -> dict[str, Any]:
    """The record written for ``path`` (there or at its fallback path)."""
    from memlab.measure.summary import read_summary

    return read_summary(path) or {"status": "failed", "error": f"no record at {path}"}


def outputs_roots(hc) -> list[str]:
    """The outputs tree of this Hydra app, where ``train.resume_from=latest`` looks: the
    directory that holds ``hydra.run.dir`` and ``hydra.sweep.dir`` (their part before the first
    ``${...}``, up to its last ``/``): ``outputs/`` and ``multirun/`` by default; a fixed run dir
    ``runs/a`` -> ``runs/`` (a bare name: that directory)."""
    from omegaconf import OmegaConf

    roots = []
    for node in (hc.run, hc.sweep):
        fixed = str(OmegaConf.to_container(node, resolve=False).get("dir") or "")
        fixed = fixed.split("${", 1)[0].rstrip("/")
        if not fixed:
            continue
        root = Path(fixed).parent if "/" in fixed else Path(fixed)
        if str(root.absolute()) not in roots:
            roots.append(str(root.absolute()))
    return roots


RANK0_GRACE_S = 60.0


def wait_for_rank0(summary: dict[str, Any], grace_s: float = RANK0_GRACE_S) -> None:
    """A rank other than 0 whose check failed leaves the exit to rank 0, which records the
    problems: torchrun stops every rank as soon as one exits, so a rank that left first would
    stop rank 0 while it still checks (its record would read ``interrupted``, seen once under
    load). Rank 0 finds the same problems and exits; torchrun's SIGTERM then ends this wait.
    After ``grace_s`` (a failure of this rank alone) the rank exits on its own."""
    print(f"[memlab] rank {os.environ.get('RANK')}: {summary['status']}: "
          f"{summary.get('error')}; rank 0 records it", file=sys.stderr, flush=True)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        time.sleep(0.1)


def run_external(cfg, run_dir: Path, choices: dict[str, str], overrides: list[str],
                 job: dict[str, Any], print_table: bool) -> dict[str, Any]:
    """One rank of a torchrun launch (e.g. across nodes: ``torchrun --nnodes 2
    --nproc_per_node 8 ... -m memlab distributed=fsdp2``). Once the process group is up, rank 0
    tells the others its run dir (each rank's Hydra resolves ``${now:}`` itself, so their own
    dirs may differ), every rank writes its ``ranks/rank<r>.json`` there, and rank 0 merges them
    into ``summary.json``. A failing rank exits at once with status 1, so torchrun stops the
    others. Returns the merged summary on rank 0 and this rank's summary elsewhere."""
    import torch.distributed as dist

    from memlab.distributed.base import Ranks, env_rank

    rank, _, world = env_rank()
    summary = base_summary(run_dir, choices, overrides, job)
    holder: list = []

    def check(_: list) -> None:
        faults.reach(f"check:rank{rank}")
        ctx = validate(cfg, run_dir, choices, world_size=world, rank=rank)
        if not isinstance(ctx.distributed, Ranks):
            raise ConfigErrors([f"started by an external launcher with WORLD_SIZE={world}, "
                                f"but distributed={ctx.distributed.name} runs one process; use "
                                "distributed=ddp or distributed=fsdp2"])
        if job.get("num") is not None:
            raise ConfigErrors(["a Hydra sweep (-m) under torchrun would start every job in "
                                "every rank; run the sweep without torchrun: memlab starts the "
                                "ranks of each job itself (distributed.nproc)"])
        summary["config"] = _plain(cfg)
        holder.append(plan_resume(ctx, summary))

    scratch = run_dir / f".rank{rank}.check.json"
    info = RunInfo(run_dir, choices, _sweep(job))
    guarded(check, summary, run_dir / "summary.json" if rank == 0 else scratch,
            on_end=(lambda s, box: late_logger(cfg, info, s, box)) if rank == 0 else None)
    scratch.unlink(missing_ok=True)  # every rank finds the same problems; rank 0 records them
    if not holder:
        if rank:
            wait_for_rank0(summary)
        return summary
    ctx = holder[0]
    ctx.distributed.setup(ctx)
    shared = [str(Path(run_dir).resolve())]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])
    ctx = dataclasses.replace(ctx, run_dir=root)
    mine = base_summary(root, choices, overrides, job)
    mine["rank"] = rank
    guarded(lambda box: execute(ctx, mine, box), mine, root / "ranks" / f"rank{rank}.json")
    if mine["status"] != "ok":
        ctx.distributed.teardown()
        # torchrun stops the other ranks
        raise SystemExit(exit_code(mine) if mine["status"] == "interrupted" else 1)
    dist.barrier()
    if rank == 0:
        summary.update(run_dir=str(root))
        guarded(lambda _: launch.merge(summary, root / "ranks", world, [0] * world), summary,
                root / "summary.json")
        if print_table:
            print(format_table(summary), flush=True)
    ctx.distributed.teardown()
    if rank and Path(run_dir).resolve() != root:
        own = Path(run_dir)
        if own.is_dir() and all(p.name == ".hydra" or p.suffix == ".log"
                                for p in own.iterdir()):
            shutil.rmtree(own, ignore_errors=True)  # this rank's empty Hydra dir
        return mine
    return summary if rank == 0 else mine
