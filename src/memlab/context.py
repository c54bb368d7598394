"""The typed spine of a run: :func:`validate` turns a composed Hydra config into a
:class:`BuildContext` (every group's choice, typed by that group's Protocol, plus the device,
the world size and the machine), reporting every problem at once.

The context's type and the group Protocols are the contracts of :mod:`memlab.protocols`
(``memlab.context.BuildContext`` is :class:`memlab.protocols.BuildContext`): every builder reads
the context, never the raw config, and only through them. ``ctx.method`` is a
:class:`~memlab.protocols.Method`, whatever option the run chose. A capability that only some
options have is its own small Protocol, asked for through the group's ``as_<capability>()``
(None: the option does not have it), so no code tests an option's class or attributes. mypy
checks every registered option against its group's Protocol (the group's typed ``register``)
and every use of the context against the Protocols.

It needs nothing but the registry, the top-level configs and the contracts, none of which
imports it (importing it imports no torch: the command line starts fast).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from memlab import faults
from memlab.config import (
    MeasureConfig,
    Platform,
    TrainConfig,
    cpu_bf16_env_problems,
    trl_hint,
)
from memlab.protocols import BuildContext
from memlab.registry import GROUPS, ConfigErrors, build, from_mapping
from memlab.trainer.inputs import NAMES as INPUT_NAMES

TOP_LEVEL = frozenset(GROUPS) | {"train", "measure"}
"""The keys a composed config may hold: the groups, ``train`` and ``measure``."""


def plain_config(cfg: Any) -> dict[str, Any]:
    """A composed config (an OmegaConf node or a mapping) as plain, resolved Python data."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        data = OmegaConf.to_container(cfg, resolve=True)
        if not isinstance(data, dict):
            raise TypeError(f"a config is a mapping, not {type(data).__name__}")
        return {str(k): v for k, v in data.items()}
    return dict(cfg)


def resolved_options(config: Mapping[str, Any], ctx: BuildContext) -> dict[str, str]:
    """The groups whose composed option stands for another in this run (``precision=auto`` ->
    ``bf16_mixed``), each with the option the run trains with. ``config``: :func:`plain_config`
    of the composed config."""
    return {group: opt.name for group, opt in ctx.groups().items()
            if (config.get(group) or {}).get("name") != opt.name}


def resolve_device(requested: str, platform: Platform) -> str:
    """``train.device``: ``auto`` is CUDA where the platform has it, else the CPU."""
    if requested == "auto":
        return "cuda" if platform.cuda else "cpu"
    return requested


def validate(cfg: Any, run_dir: Path | str = ".", choices: Mapping[str, str] | None = None,
             world_size: int | None = None, rank: int = 0,
             platform: Platform | None = None) -> BuildContext:
    """Every group node -> typed config, then every cross-group rule. Raises ConfigErrors with
    all problems at once. Loads no model and no data. ``world_size`` None: the processes the
    distributed option asks for; ``platform`` None: this machine."""
    data = plain_config(cfg)
    errors: list[str] = []
    typed: dict[str, Any] = {}
    for key in sorted(set(data) - TOP_LEVEL):
        other = trl_hint(key, data[key])
        errors.append(f"unknown top-level key {key!r}" + (f"; {other}" if other else "")
                      + f" (valid: {', '.join(sorted(TOP_LEVEL))})")
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
    train, errs = from_mapping(TrainConfig, data.get("train") or {}, "train", partial=True,
                               renamed=lambda key: trl_hint(key, (data["train"] or {}).get(
                                   key.split(".", 1)[1])))
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
    if world_size is None:
        world_size = typed["distributed"].processes(device, platform.gpus)
    typed["precision"] = typed["precision"].resolved(device, platform)
    ctx = BuildContext(
        **typed, train=train, measure=measure, device=device, world_size=world_size,
        rank=rank, choices=dict(choices or {}), run_dir=Path(run_dir), platform=platform,
    )
    for opt in ctx.groups().values():
        errors += opt.validate(ctx)
    errors += checkpoint_errors(train, ctx)
    errors += eval_errors(train, ctx)
    errors += train.errors()
    errors += measure.errors(train)
    errors += faults.problems()  # a test hook left in the environment would hang the run
    errors += cpu_bf16_env_problems()
    if errors:
        raise ConfigErrors(errors)
    return ctx


def checkpoint_errors(train: TrainConfig, ctx: BuildContext) -> list[str]:
    """Problems of ``train``'s saving / resuming knobs (``ctx``: the run's other choices)."""
    errors = []
    if train.save_merged:
        if not ctx.peft.has_adapter():
            errors.append(f"train.save_merged=true merges a PEFT adapter into its base, and "
                          f"peft={ctx.peft.name} trains the whole model (its checkpoint is "
                          "the model already); drop train.save_merged")
        if not (train.save_final or train.save_every):
            errors.append("train.save_merged=true but nothing is saved; set "
                          "train.save_final=true or train.save_every=N")
    if train.resume_allow and not train.resume_from:
        errors.append("train.resume_allow names settings a resumed run may change, but "
                      "train.resume_from is null; set train.resume_from=<dir> or latest")
    known = {"train": [f.name for f in fields(TrainConfig)],
             "measure": [f.name for f in fields(MeasureConfig)]}
    for group, opt in ctx.groups().items():
        known[group] = ["name", *(f.name for f in fields(opt))]
    known["inputs"] = list(INPUT_NAMES)  # files read in: data, model, tokenizer, template
    for key in train.resume_allow:
        head, _, rest = key.partition(".")
        sub = rest.partition(".")[0]
        if head not in known or (sub and sub not in known[head]):
            pool = list(known) if head not in known else [f"{head}.{k}" for k in known[head]]
            close = difflib.get_close_matches(key, pool, n=1)
            errors.append(f"train.resume_allow: {key!r} is not a setting of this run"
                          + (f"; did you mean {close[0]!r}?" if close else "")
                          + " (a group such as 'peft', 'group.key' such as 'train.lr', or "
                          "an input read in such as 'inputs.data')")
    if train.resume_root is not None and not Path(train.resume_root).is_dir():
        errors.append(f"train.resume_root={train.resume_root}: no such directory")
    return errors


def eval_errors(train: TrainConfig, ctx: BuildContext) -> list[str]:
    """Problems of ``train``'s evaluation knobs (``ctx``: the run's other choices): evaluation
    needs held-out data, and ``best_metric`` must be one the method's evaluation reports."""
    errors = []
    if ctx.data.eval is None:
        asked = [f"train.{k}" for k, on in (
            ("eval_every", train.eval_every), ("eval_samples", train.eval_samples),
            ("save_best", train.save_best), ("early_stop", train.early_stop is not None),
            ("best_metric", train.best_metric is not None),
            ("eval_batch_size", train.eval_batch_size is not None)) if on]
        if asked:
            errors.append(f"{', '.join(asked)} evaluate on held-out data, and data.eval is "
                          "null; hold some out: data.eval=0.05 (a fraction of the rows), "
                          "data.eval=<file> or, for data=hub, data.eval=<split>")
        return errors
    metrics = ctx.method.eval_metrics
    if train.best_metric is not None and train.best_metric not in metrics:
        close = difflib.get_close_matches(train.best_metric, metrics, n=1)
        errors.append(f"train.best_metric={train.best_metric}: method={ctx.method.name}'s "
                      f"evaluation reports {', '.join(metrics)}"
                      + (f"; did you mean {close[0]!r}?" if close else ""))
    return errors


def validate_for(cfg, device: str, choices: dict[str, str] | None = None):
    """:func:`validate` of ``cfg`` as an estimate of a run on ``device`` (cpu | cuda): a CUDA
    machine with the GPU extras where this one has no CUDA, vLLM taken as installed (an
    estimate models its engine, never starts it). Here, not in :mod:`memlab.estimate`, so that
    a caller that only validates (a benchmark's dry run) does not import the estimator."""
    import dataclasses

    from omegaconf import OmegaConf, open_dict

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)) if OmegaConf.is_config(
        cfg) else OmegaConf.create(dict(cfg))
    with open_dict(cfg):
        cfg.train.device = device
        cfg.measure.memory = True
    platform = Platform.detect()
    if device == "cuda" and not platform.cuda:  # a CUDA machine with the GPU extras
        platform = Platform.cuda_machine()
    # an estimate never starts a vLLM engine (it models one): vLLM need not be installed here
    platform = dataclasses.replace(platform, assume_installed=platform.assume_installed
                                   | {"vllm"})
    return validate(cfg, ".", choices, platform=platform)
