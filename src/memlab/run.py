"""validate -> pipeline -> train -> summary. Every outcome (ok, invalid, failed, oom) ends in an
atomically written summary.json in the run dir; nothing is lost when a sweep job fails.

A run of several processes is started here too: with ``world_size > 1`` this process starts
the ranks (``memlab.distributed.launch``; each rank is ``python -m memlab.rank``) and merges
their records; under an external launcher (torchrun) every process is a rank already
(:func:`run_external`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

from memlab.config import BuildContext, MeasureConfig, Platform, TrainConfig
from memlab.distributed import launch
from memlab.measure.summary import (
    device_info,
    format_table,
    user_choices,
    versions,
    write_atomic,
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
    for group in GROUPS:
        node = data.get(group)
        if not isinstance(node, dict):
            errors.append(f"{group}: missing config group (add '{group}: <option>' to defaults)")
            continue
        obj, errs = build(group, node)
        errors += errs
        typed[group] = obj
    train, errs = from_mapping(TrainConfig, data.get("train") or {}, "train")
    errors += errs
    measure, errs = from_mapping(MeasureConfig, data.get("measure") or {}, "measure")
    errors += errs
    if errors:
        raise ConfigErrors(errors)
    assert train is not None and measure is not None
    platform = platform or Platform.detect()
    device = resolve_device(train.device, platform)
    if device == "cuda" and not platform.cuda:
        errors.append("train.device=cuda but no CUDA device is visible; use train.device=auto")
    for name, value in (("steps", train.steps), ("batch_size", train.batch_size),
                        ("grad_accum", train.grad_accum), ("checkpoint_every",
                                                           train.checkpoint_every)):
        if value < 1:
            errors.append(f"train.{name} must be >= 1 (got {value})")
    if isinstance(measure.memory_steps, int) and measure.memory_steps < 0:
        errors.append("measure.memory_steps must be 'auto', 'all' or >= 0")
    if world_size is None:
        world_size = typed["distributed"].processes(device, platform.gpus)
    ctx = BuildContext(
        **typed, train=train, measure=measure, device=device, world_size=world_size,
        rank=rank, choices=dict(choices or {}), run_dir=Path(run_dir), platform=platform,
    )
    for group in GROUPS:
        errors += typed[group].validate(ctx)
    errors += train.checkpoint_errors(ctx)
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

    guarded(body, summary, run_dir / "summary.json")
    if print_table:
        print(format_table(summary), flush=True)
    return summary


def guarded(body, summary: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run ``body(logger_box)`` and record its outcome in ``summary`` (ok / invalid / oom /
    failed, with the error), then write it atomically to ``out``; never raises for a failing
    job (except KeyboardInterrupt, and anything under ``MEMLAB_RAISE=1``)."""
    t0 = time.perf_counter()
    run_dir = out.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    logger_box: list = []
    try:
        summary["versions"] = versions()
        body(logger_box)
        summary["status"] = "ok"
    except ConfigErrors as e:
        summary["status"] = "invalid"
        summary["error"] = str(e)
    except BaseException as e:  # noqa: BLE001 - recorded, not swallowed silently
        from memlab.measure.memory import is_oom

        if isinstance(e, KeyboardInterrupt):
            summary["status"] = "failed"
            summary["error"] = "interrupted"
            raise
        summary["status"] = "oom" if is_oom(e) else "failed"
        summary["error"] = f"{type(e).__name__}: {e}"
        err = "error.txt" if out.name == "summary.json" else f"{out.stem}.error.txt"
        (run_dir / err).write_text(traceback.format_exc())
        if os.environ.get("MEMLAB_RAISE"):
            raise
    finally:
        summary["wall_time_s"] = time.perf_counter() - t0
        write_atomic(out, summary)
        if logger_box:
            try:
                logger_box[0].finish(summary)
            except Exception as e:  # noqa: BLE001
                print(f"[memlab] logger.finish failed: {e}")
    return summary


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

    logger = ctx.logger.start(ctx, {**summary.get("config", {}), "_sweep_dir": summary["job"].get(
        "sweep_dir")})
    logger_box.append(logger)
    pipe = pipeline.build(ctx, logger=logger)
    trainer = pipe.trainer
    summary["data"] = pipe.stats.as_dict()
    try:
        result = trainer.train()
    finally:
        summary["memory"] = trainer.probe.result()
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
    from memlab.trainer.checkpoint import step_dirs

    ckpts = Path(ctx.run_dir) / "checkpoints"
    if ctx.train.save_final and not (ctx.train.save_every and result.steps % ctx.train.save_every
                                     == 0 and (ckpts / f"step_{result.steps:06d}").is_dir()):
        trainer.save_checkpoint()  # (unless the loop saved this step already)
    saved = step_dirs(ckpts)
    summary["throughput"] = result.throughput()
    summary["data"]["padding_fraction"] = result.padding_fraction()
    summary["data"]["tokens_trained"] = result.real_tokens
    summary["train"] = {
        "final_loss": result.losses[-1] if result.losses else None,
        "steps": result.steps,
        "loss_curve": result.losses,
        "final_metrics": result.metrics,
        "curves": result.curves,
        "checkpoint": str(saved[-1]) if saved else None,  # the newest of this run dir
    }


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
    summary = run(cfg, hc.runtime.output_dir, choices, list(hc.overrides.task), job)
    if not multirun and summary["status"] != "ok":
        raise SystemExit(1 if summary["status"] != "invalid" else 2)
    return summary


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
    guarded(check, summary, run_dir / "summary.json" if rank == 0 else scratch)
    scratch.unlink(missing_ok=True)  # every rank finds the same problems; rank 0 records them
    if not holder:
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
        raise SystemExit(1)  # torchrun stops the other ranks
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
