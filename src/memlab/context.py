"""The typed spine of a run: :class:`BuildContext` (every group's choice, typed by that group's
Protocol, plus the device, the world size and the machine) and :func:`validate`, which turns a
composed Hydra config into one, reporting every problem at once.

Every builder reads the context, never the raw config, and only through the group Protocols
(``memlab/<group>/base.py``): ``ctx.method`` is a :class:`~memlab.method.base.Method`, whatever
option the run chose. A capability that only some options have is its own small Protocol, asked
for through the group's ``as_<capability>()`` (None: the option does not have it), so no code
tests an option's class or attributes. mypy checks every registered option against its group's
Protocol (the group's typed ``register``) and every use of the context against the Protocols.

The group modules import this module for their annotations only (under ``TYPE_CHECKING``); at
run time it needs nothing but the registry and the top-level configs (importing it imports no
torch: the command line starts fast).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlab import faults
from memlab.config import MeasureConfig, Platform, TrainConfig, cpu_bf16_env_problems, trl_hint
from memlab.registry import GROUPS, ConfigErrors, Option, build, from_mapping

if TYPE_CHECKING:
    from memlab.attention.base import Attention
    from memlab.data.base import DataSource
    from memlab.distributed.base import Distributed
    from memlab.generation.base import Generation
    from memlab.logger.base import Logger
    from memlab.method.base import Method
    from memlab.model.base import Model
    from memlab.offload.base import Offload
    from memlab.optimizer.base import Optimizer
    from memlab.packing.base import PackingOption
    from memlab.peft.base import Peft
    from memlab.precision.base import Precision

TOP_LEVEL = frozenset(GROUPS) | {"train", "measure"}
"""The keys a composed config may hold: the groups, ``train`` and ``measure``."""


@dataclass(frozen=True)
class BuildContext:
    """Everything a builder may know besides its own config: the other groups' choices, the
    device and the world size. Frozen: builders read it, never change it."""

    method: Method
    generation: Generation
    packing: PackingOption
    attention: Attention
    precision: Precision
    offload: Offload
    peft: Peft
    optimizer: Optimizer
    distributed: Distributed
    model: Model
    data: DataSource
    logger: Logger
    train: TrainConfig
    measure: MeasureConfig
    device: str = "cpu"
    world_size: int = 1
    rank: int = 0
    choices: dict[str, str] = field(default_factory=dict)
    run_dir: Path = Path(".")
    platform: Platform = field(default_factory=Platform)
    """The machine the run is validated for (:meth:`Platform.detect` in a run)."""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def groups(self) -> dict[str, Option]:
        """The typed config of every group, by group name (for code that treats every group
        alike: recording a configuration, listing its settings)."""
        return {"method": self.method, "generation": self.generation, "packing": self.packing,
                "attention": self.attention, "precision": self.precision,
                "offload": self.offload, "peft": self.peft, "optimizer": self.optimizer,
                "distributed": self.distributed,
                "model": self.model, "data": self.data, "logger": self.logger}


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
    errors += train.checkpoint_errors(ctx)
    errors += train.eval_errors(ctx)
    errors += measure.errors(train)
    errors += faults.problems()  # a test hook left in the environment would hang the run
    errors += cpu_bf16_env_problems()
    if errors:
        raise ConfigErrors(errors)
    return ctx
