"""`logger=wandb`: Weights & Biases, online or offline (``wandb sync`` later).

What a W&B user expects, and how memlab meets it:

- **W&B's own settings work.** ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_TAGS``,
  ``WANDB_RUN_GROUP``, ``WANDB_NAME``, ``WANDB_NOTES``, ``WANDB_JOB_TYPE``, ``WANDB_MODE``
  (and ``WANDB_DISABLED``) and ``WANDB_DIR`` apply as they do to any W&B script; a value set in
  memlab's config (``logger.project=...``) wins over the variable, and memlab's own defaults
  (project ``memlab``, offline, the sweep's group and run names, the run dir) apply only where
  neither sets one. Tags add up: the config's, ``WANDB_TAGS``' and memlab's. summary.json's
  ``logger`` records every setting and where it came from (:func:`settings`). Other variables
  (``WANDB_API_KEY``, ``WANDB_BASE_URL``, ``WANDB_RUN_ID``, ``WANDB_RESUME``...) reach W&B
  untouched.
- **W&B's own output is shown**: where the run is saved, the ``wandb sync`` line of an offline
  run, the run's URL. Only its end-of-run panel of per-step sparklines and summary values is
  off (``logger.console_panel=true`` brings it back; ``WANDB_SILENT=true`` silences W&B).
- **Every job of a sweep is a run**, the invalid and failed ones included: a job that ends
  before it trains still starts a run (with its config) and finishes it with its status and
  reason in the summary and a failed state (:func:`memlab.run.run`).
- **The run summary holds the measurements; the config stays in the config.** At the end
  summary.json's measurements (status, memory, throughput, data, train, eval...), flattened
  with ``/`` (``memory/peak_bytes``, ``memory/by_category/activations``,
  ``throughput/tokens_per_s``, ``eval/final/loss``...; lists such as the loss curve stay in the
  history), go into the run summary with one ``run.summary.update``, so no late history row
  overwrites them; its bookkeeping (the logger's settings and their sources, the device, where
  the eval rows came from...) is there too, under one ``meta/`` prefix
  (:func:`memlab.measure.summary.logged_summary`). The configuration (and the versions) are the
  W&B config only.
- **One group per sweep**, named by the sweep (``sweep=<name>`` when one was chosen) and its
  directory (``packing-2026-11-23_14-03-22``); a single run has no group.
- **Short run names, unique within a sweep**: what this job's overrides set among the keys
  the sweep varies (``peft=lora,gradient_checkpointing=false``), read from Hydra's
  ``multirun.yaml`` and the job's ``.hydra/overrides.yaml``; a single run is named by its
  overrides, or its directory when it has none.
- **Tags say what differs, config keys say everything**: a sweep job is tagged with what its
  sweep varies (``peft:lora``, ``train.gradient_checkpointing:false``), a single run with its
  overrides, so a tag tells runs apart; every group choice is a config key (``peft.name``) with
  its options (``peft.r``), which is what a cross-sweep view groups and colours by.
- Per step: the metrics the trainer logs (``train/loss``, ``throughput/tokens_per_s``... and
  ``memory/step_peak_bytes`` on tracked steps); at evaluations ``eval/<metric>`` and the sample
  completions as a table, ``eval/samples``. Only rank 0 logs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from memlab.logger.base import LoggerRun, NullRun, RunInfo, register
from memlab.measure.summary import logged_summary, user_choices
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext

TAG_MAX = 64
"""W&B's longest tag."""
NAME_MAX = 128
GROUP_MAX = 128
DEFAULT_PROJECT = "memlab"
DEFAULT_MODE = "offline"

ENV = {"project": "WANDB_PROJECT", "entity": "WANDB_ENTITY", "mode": "WANDB_MODE",
       "group": "WANDB_RUN_GROUP", "name": "WANDB_NAME", "notes": "WANDB_NOTES",
       "job_type": "WANDB_JOB_TYPE", "dir": "WANDB_DIR", "tags": "WANDB_TAGS"}
"""W&B's environment variable of each setting."""



@register("wandb")
@dataclass(kw_only=True)
class WandbLogger(Option):
    """W&B run settings. Each one left null is W&B's environment variable, else memlab's
    default (module docstring)."""

    project: str | None = None
    """null: ``WANDB_PROJECT``, else ``memlab``."""
    entity: str | None = None
    """null: ``WANDB_ENTITY``, else your W&B default entity."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """null: ``WANDB_MODE`` (``WANDB_DISABLED=true``: disabled), else offline (written under
    the run dir; ``wandb sync`` later)."""
    group: str | None = None
    """null: ``WANDB_RUN_GROUP``, else the sweep (its name and dir: see the module docstring);
    none for one run."""
    run_name: str | None = None
    """null: ``WANDB_NAME``, else what this job sets among what its sweep varies (its
    overrides for one run)."""
    tags: list[str] = field(default_factory=list)
    """Extra tags, added to ``WANDB_TAGS`` (comma-separated) and to memlab's: what the sweep
    varies (a single run: its overrides) as 'key:value'."""
    notes: str | None = None
    """null: ``WANDB_NOTES``."""
    job_type: str | None = None
    """null: ``WANDB_JOB_TYPE``."""
    dir: str | None = None
    """Where W&B writes its files. null: ``WANDB_DIR``, else the run dir."""
    console_panel: bool = False
    """Print W&B's end-of-run panel (a sparkline per logged metric, the summary values);
    off by default, everything else W&B prints is shown."""

    def validate(self, ctx: BuildContext) -> list[str]:
        err = ctx.platform.missing("wandb", "logger=wandb")
        return [err] if err else []

    def start(self, info: RunInfo, config: dict[str, Any]) -> LoggerRun:
        if info.rank != 0:
            return NullRun()
        import wandb

        chosen, sources = settings(self, info, os.environ)
        lines = 10 if self.console_panel else 0  # metrics in W&B's end-of-run panel
        run = wandb.init(**chosen, config=config, reinit="finish_previous",
                         settings=wandb.Settings(max_end_of_run_history_metrics=lines,
                                                 max_end_of_run_summary_metrics=lines))
        rename = {"name": "run_name"}
        described = {rename.get(k, k): v for k, v in chosen.items()}
        described["sources"] = {rename.get(k, k): v for k, v in sources.items()}
        described["id"] = run.id
        if chosen["mode"] == "online":
            described["url"] = run.url
        return WandbRun(run, described)


def _env_mode(env: Mapping[str, str]) -> str | None:
    """W&B's mode from the environment (its legacy spellings too), or None."""
    if str(env.get("WANDB_DISABLED", "")).lower() in ("true", "1", "yes"):
        return "disabled"
    mode = str(env.get("WANDB_MODE", "")).lower()
    return {"dryrun": "offline", "run": "online"}.get(mode, mode) or None


def settings(opt: WandbLogger, info: RunInfo, env: Mapping[str, str]
             ) -> tuple[dict[str, Any], dict[str, str]]:
    """``(wandb.init's settings, where each came from)``: the config's value, else W&B's
    environment variable, else memlab's default (module docstring). Sources read ``config``,
    ``env WANDB_...`` or ``memlab``; tags list every source that added some."""
    choices = user_choices(info.choices)
    names = run_names(info.run_dir, info.sweep_dir, choices)
    defaults: dict[str, Any] = {
        "project": DEFAULT_PROJECT, "entity": None, "mode": DEFAULT_MODE,
        "group": names["group"], "name": names["name"], "notes": None, "job_type": None,
        "dir": str(info.run_dir)}
    given = {"project": opt.project, "entity": opt.entity, "mode": opt.mode,
             "group": opt.group, "name": opt.run_name, "notes": opt.notes,
             "job_type": opt.job_type, "dir": opt.dir}
    from_env = {k: env.get(ENV[k]) or None for k in given}
    from_env["mode"] = _env_mode(env)
    chosen: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, value in given.items():
        if value is not None:
            chosen[key], sources[key] = value, "config"
        elif from_env[key] is not None:
            chosen[key], sources[key] = from_env[key], f"env {ENV[key]}"
        else:
            chosen[key] = defaults[key]
            sources[key] = "memlab" if defaults[key] is not None else "wandb"
    ours = [f"{k}:{v}" for k, v in names["varying"]]  # what tells this run from its siblings
    env_tags = [t.strip() for t in str(env.get(ENV["tags"], "")).split(",") if t.strip()]
    chosen["tags"] = list(dict.fromkeys(t[:TAG_MAX] for t in [*opt.tags, *env_tags, *ours]))
    sources["tags"] = ", ".join(name for name, tags in (
        ("config", opt.tags), (f"env {ENV['tags']}", env_tags), ("memlab", ours)) if tags)
    return chosen, sources


def measurements(summary: dict[str, Any]) -> dict[str, Any]:
    """The W&B run summary of summary.json: its measurements flattened with ``/``, its
    bookkeeping under ``meta/`` (:func:`memlab.measure.summary.logged_summary`)."""
    return logged_summary(summary)


class WandbRun:
    """A started W&B run (rank 0): the connection lives here, not on the config."""

    def __init__(self, run: Any, described: dict[str, Any] | None = None):
        self.run = run
        self.described = dict(described or {})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        samples = metrics.get("eval/samples")
        if samples is not None:
            import wandb

            metrics = dict(metrics)
            metrics["eval/samples"] = wandb.Table(
                columns=["step", "prompt", "completion"],
                data=[[r["step"], r["prompt"], r["completion"]] for r in samples])
        # committed now: a row left pending would be flushed at finish, after the summary
        self.run.log(metrics, step=step, commit=True)

    def describe(self) -> dict[str, Any]:
        return {"option": "wandb", **self.described}

    def finish(self, summary: dict[str, Any]) -> None:
        import wandb

        self.run.summary.update(measurements(summary))
        self.run.finish(exit_code=0 if summary.get("status") == "ok" else 1)
        # the service this process started ends with the run: it would outlive the job, and
        # WANDB_SERVICE (where it listens) would lead every process started later from here,
        # the next job of an in-process sweep among them, into the ended run's service
        wandb.teardown()


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
    sweep's ``multirun.yaml`` and the job's ``.hydra/overrides.yaml``. ``varying``: what the
    sweep varies, as this job sets it; a single run's overrides."""
    from memlab.measure.summary import short_label

    job = {o.key_or_group: _value_text(o) for o in
           _parse(_read_list(run_dir / ".hydra" / "overrides.yaml"))
           if not o.key_or_group.startswith(("hydra.", "hydra/"))}
    if sweep_dir is None:
        varying = list(job.items())
        name = short_label(varying) or run_dir.name
        return {"group": None, "name": name[:NAME_MAX], "varying": varying}
    varying = [(k, job[k]) for k in sweep_varying(sweep_dir) if k in job]
    name = short_label(varying) or run_dir.name
    return {"group": sweep_group(sweep_dir, choices.get("sweep")), "name": name[:NAME_MAX],
            "varying": varying}
