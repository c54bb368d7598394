"""`logger=wandb`: Weights & Biases, online or offline (``wandb sync`` later).

Runs of one sweep share a W&B group (the sweep dir), are tagged with their group choices
(``method:sft``, ``peft:lora`` ...), and log the same metric names as summary.json
(``memory/peak_bytes``, ``throughput/tokens_per_s`` ...). Only rank 0 logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

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

    def __post_init__(self) -> None:
        self._run = None

    def validate(self, ctx) -> list[str]:
        from memlab._guards import missing

        err = missing("wandb", "logger=wandb")
        return [err] if err else []

    def start(self, ctx, config: dict[str, Any]) -> None:
        if ctx.rank != 0:
            return
        import wandb

        choices = ctx.choices
        group = self.group or config.get("_sweep_dir") or ctx.run_dir.name
        tags = [f"{k}:{v}" for k, v in sorted(choices.items())] + list(self.tags)
        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.mode,
            group=str(group)[-128:],
            name=self.run_name or "-".join(f"{k}={v}" for k, v in sorted(choices.items())),
            tags=[t[:64] for t in tags],
            dir=self.dir or str(ctx.run_dir),
            config={k: v for k, v in config.items() if not k.startswith("_")},
            reinit="finish_previous",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._run is not None:
            self._run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._run is None:
            return
        from memlab.measure.summary import flatten

        for key, value in flatten(summary).items():
            if isinstance(value, (int, float, str, bool)) or value is None:
                self._run.summary[key] = value
        self._run.finish(exit_code=0 if summary.get("status") == "ok" else 1)
        self._run = None
