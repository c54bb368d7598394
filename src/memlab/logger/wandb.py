"""`logger=wandb`: Weights & Biases, online or offline (``wandb sync`` later).

Runs of one sweep share a W&B group (the sweep dir), are tagged with their group choices
(``method:sft``, ``peft:lora`` ...), and log the same metric names as summary.json
(``memory/peak_bytes``, ``throughput/tokens_per_s`` ...). Only rank 0 logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from memlab.logger.base import LoggerRun, NullRun
from memlab.measure.summary import flatten
from memlab.registry import register


@register("logger", "wandb")
@dataclass(kw_only=True)
class WandbLogger:
    """W&B run settings."""

    project: str = "memlab"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] = "offline"
    """offline writes ./wandb/offline-run-* under the run dir; sync with `wandb sync`."""
    group: str | None = None
    """Defaults to the sweep dir (multirun) or the run dir name (single run)."""
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    """Extra tags; every group choice is added as 'group:option'."""
    dir: str | None = None
    """Where W&B writes its files; defaults to the run dir."""

    def validate(self, ctx) -> list[str]:
        err = ctx.platform.missing("wandb", "logger=wandb")
        return [err] if err else []

    def start(self, ctx, config: dict[str, Any]) -> LoggerRun:
        if ctx.rank != 0:
            return NullRun()
        import wandb

        choices = ctx.choices
        group = self.group or config.get("_sweep_dir") or ctx.run_dir.name
        tags = [f"{k}:{v}" for k, v in sorted(choices.items())] + list(self.tags)
        os.environ.setdefault("WANDB_SILENT", "true")
        return WandbRun(wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.mode,
            group=str(group)[-128:],
            name=self.run_name or "-".join(f"{k}={v}" for k, v in sorted(choices.items())),
            tags=[t[:64] for t in tags],
            dir=self.dir or str(ctx.run_dir),
            config={k: v for k, v in config.items() if not k.startswith("_")},
            reinit="finish_previous",
        ))


class WandbRun:
    """A started W&B run (rank 0)."""

    def __init__(self, run: Any):
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        for key, value in flatten(summary).items():
            if isinstance(value, (int, float, str, bool)) or value is None:
                self.run.summary[key] = value
        self.run.finish(exit_code=0 if summary.get("status") == "ok" else 1)
