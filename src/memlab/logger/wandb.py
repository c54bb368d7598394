"""`logger=wandb`: Weights & Biases, online or offline (``wandb sync`` later).

What a W&B user expects, and how memlab meets it:

- **The run summary is summary.json.** Every step is committed as it is logged, and at the end
  the whole summary.json, flattened with ``/`` (``memory/peak_bytes``,
  ``memory/by_category/activations``, ``throughput/tokens_per_s``...; lists such as the loss
  curve stay in the history), goes into the run summary with one ``run.summary.update``, so no
  late history row overwrites it.
- **One group per sweep**, named by the sweep (``sweep=<name>`` when one was chosen) and its
  directory (``packing-2026-11-23_14-03-22``); a single run has no group.
- **Short run names, unique within a sweep**: what this job's overrides set among the keys
  the sweep varies (``peft=lora,gradient_checkpointing=false``), read from Hydra's
  ``multirun.yaml`` and the job's ``.hydra/overrides.yaml``; a single run is named by its
  overrides, or its directory when it has none.
- **Everything that varies is a tag or a config key**: each group choice is a tag
  (``peft:lora``) and its options are config keys (``peft.r``); every other varying override is
  a tag too (``train.gradient_checkpointing:false``) besides its config key.
- Per step: the metrics the trainer logs (``train/loss``, ``throughput/tokens_per_s``... and
  ``memory/step_peak_bytes`` on tracked steps). Only rank 0 logs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from memlab.logger.base import LoggerRun, NullRun, register
from memlab.measure.summary import flatten, user_choices
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext

TAG_MAX = 64
"""W&B's longest tag."""
NAME_MAX = 128
GROUP_MAX = 128


@register("wandb")
@dataclass(kw_only=True)
class WandbLogger(Option):
    """W&B run settings."""

    project: str = "memlab"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] = "offline"
    """offline writes ./wandb/offline-run-* under the run dir; sync with `wandb sync`."""
    group: str | None = None
    """Defaults to the sweep (its name and dir: see the module docstring); none for one run."""
    run_name: str | None = None
    """Defaults to what this job sets among what its sweep varies (its overrides for one run)."""
    tags: list[str] = field(default_factory=list)
    """Extra tags; every group choice and every varying override is added as 'key:value'."""
    dir: str | None = None
    """Where W&B writes its files; defaults to the run dir."""

    def validate(self, ctx: BuildContext) -> list[str]:
        err = ctx.platform.missing("wandb", "logger=wandb")
        return [err] if err else []

    def start(self, ctx: BuildContext, config: dict[str, Any]) -> LoggerRun:
        if ctx.rank != 0:
            return NullRun()
        import wandb

        choices = user_choices(ctx.choices)
        sweep_dir = config.get("_sweep_dir")
        names = run_names(Path(ctx.run_dir), Path(sweep_dir) if sweep_dir else None, choices)
        tags = [f"{k}:{v}" for k, v in sorted(choices.items())]
        tags += [f"{k}:{v}" for k, v in names["varying"] if k not in choices]
        tags = list(dict.fromkeys(t[:TAG_MAX] for t in [*tags, *self.tags]))
        os.environ.setdefault("WANDB_SILENT", "true")
        return WandbRun(wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.mode,
            group=self.group or names["group"],
            name=self.run_name or names["name"],
            tags=tags,
            dir=self.dir or str(ctx.run_dir),
            config={k: v for k, v in config.items() if not k.startswith("_")},
            reinit="finish_previous",
        ))


class WandbRun:
    """A started W&B run (rank 0): the connection lives here, not on the config."""

    def __init__(self, run: Any):
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        # committed now: a row left pending would be flushed at finish, after the summary
        self.run.log(metrics, step=step, commit=True)

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(flatten(summary))
        self.run.finish(exit_code=0 if summary.get("status") == "ok" else 1)


# ------------------------------------------------------------------------------ names


def _read_list(path: Path) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(x) for x in data] if isinstance(data, list) else []


def _parse(overrides: Sequence[str]) -> list[Any]:
    """Hydra's own parse of ``overrides`` (unparsable ones left out)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = []
    for o in overrides:
        try:
            out.extend(parser.parse_overrides([o]))
        except Exception:  # noqa: BLE001 - a name is best effort; the run goes on
            continue
    return out


def _value_text(override: Any) -> str:
    """An override's value as a user writes it (Hydra's sweeper records ``True``: ``true``)."""
    try:
        value = override.value()
    except Exception:  # noqa: BLE001 - sweeps and functions: Hydra's own rendering
        return override.get_value_element_as_str()
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    if isinstance(value, (int, float, str)):
        return str(value)
    return override.get_value_element_as_str()


def sweep_varying(sweep_dir: Path) -> list[str]:
    """The keys a Hydra sweep varies: its sweep overrides (``a=x,y``, ``range()``, ``glob()``...)
    from the command line and from ``hydra.sweeper.params``, read from its ``multirun.yaml``."""
    import yaml

    try:
        data = yaml.safe_load((sweep_dir / "multirun.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    hydra = data.get("hydra") or {}
    task = list((hydra.get("overrides") or {}).get("task") or [])
    params = (hydra.get("sweeper") or {}).get("params") or {}
    task += [f"{k}={v}" for k, v in params.items()]
    keys: list[str] = []
    for o in _parse(task):
        if o.is_sweep_override() and o.key_or_group not in keys:
            keys.append(o.key_or_group)
    return keys


def sweep_group(sweep_dir: Path, sweep_name: str | None = None) -> str:
    """``<sweep name>-<dir>``: the dir's basename, with its date when Hydra's default
    ``<date>/<time>`` layout would make the time alone ambiguous."""
    label = sweep_dir.name
    if re.fullmatch(r"\d\d-\d\d-\d\d", label) and re.fullmatch(r"\d{4}-\d\d-\d\d",
                                                              sweep_dir.parent.name):
        label = f"{sweep_dir.parent.name}_{label}"
    return (f"{sweep_name}-{label}" if sweep_name else label)[:GROUP_MAX]


def run_names(run_dir: Path, sweep_dir: Path | None, choices: dict[str, str]) -> dict[str, Any]:
    """``{"group", "name", "varying": [(key, value)]}`` of one job from Hydra's files: the
    sweep's ``multirun.yaml`` and the job's ``.hydra/overrides.yaml``."""
    from memlab.measure.summary import short_label

    job = {o.key_or_group: _value_text(o) for o in
           _parse(_read_list(run_dir / ".hydra" / "overrides.yaml"))
           if not o.key_or_group.startswith(("hydra.", "hydra/"))}
    if sweep_dir is None:
        varying: list[tuple[str, str]] = []
        name = short_label(job.items()) or run_dir.name
        return {"group": None, "name": name[:NAME_MAX], "varying": varying}
    varying = [(k, job[k]) for k in sweep_varying(sweep_dir) if k in job]
    name = short_label(varying) or run_dir.name
    return {"group": sweep_group(sweep_dir, choices.get("sweep")), "name": name[:NAME_MAX],
            "varying": varying}
