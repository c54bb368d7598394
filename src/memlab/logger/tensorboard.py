"""`logger=tensorboard`: TensorBoard event files (torch's ``SummaryWriter``), under the run dir.

The same keys as ``logger=wandb``, so a view built on one reads the other:

- **Per step** (every ``train.log_every`` and at evaluations): ``train/loss``, ``train/lr``,
  ``train/grad_norm``, ``throughput/tokens_per_s``, ``data/padding_fraction``,
  ``memory/step_peak_bytes`` on the steps the memory tracker ran, ``eval/<metric>`` at
  evaluations: scalars at the step; the sample completions (``train.eval_samples``) as a text,
  ``eval/samples`` (a markdown table).
- **At the end**, summary.json's measurements, flattened with ``/`` as W&B's run summary is
  (:func:`memlab.measure.summary.logged_summary`: ``memory/peak_bytes``,
  ``memory/by_category/activations``, ``train/final_loss``, ``eval/final/loss``...): each number
  is a scalar at the run's last step. A key that is also logged per step
  (``throughput/tokens_per_s``, ``data/padding_fraction``) keeps its series alone, so a curve
  gets no second point at its last step (summary.json has the run's value). Whatever is not a
  number (the status, the error, the ``meta/`` bookkeeping) is one text, ``summary``.
- **The config** (and the versions) is a text, ``config`` (JSON), at step 0.

Scalars are written in double precision (TensorBoard's default float32 would round a byte count
above 16 MiB). Only rank 0 writes. ``tensorboard --logdir multirun/<date>/<time>`` shows every
job of a sweep, each named by its run dir (``0/tensorboard``...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memlab.logger.base import LoggerRun, NullRun, RunInfo, register
from memlab.measure.summary import logged_summary
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext

SUBDIR = "tensorboard"
"""Where the event files go inside the run dir (``logger.dir`` null)."""


@register("tensorboard")
@dataclass(kw_only=True)
class TensorboardLogger(Option):
    """TensorBoard event files (needs the ``tensorboard`` extra)."""

    dir: str | None = None
    """Where the event files go. null: ``<run dir>/tensorboard``."""

    def validate(self, ctx: BuildContext) -> list[str]:
        err = ctx.platform.missing("tensorboard", "logger=tensorboard")
        return [err] if err else []

    def start(self, info: RunInfo, config: dict[str, Any]) -> LoggerRun:
        if info.rank != 0:
            return NullRun()
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(self.dir) if self.dir else Path(info.run_dir) / SUBDIR
        writer = SummaryWriter(log_dir=str(log_dir))
        writer.add_text("config", _code(json.dumps(config, indent=2, default=str)), 0)
        writer.flush()
        return TensorboardRun(writer, str(log_dir))


def _number(value: Any) -> float | None:
    """``value`` as a scalar TensorBoard plots (an int or a float, NaN and inf too), else None
    (a string, a bool, a None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _code(text: str) -> str:
    """A text shown as it is (TensorBoard renders texts as markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


class TensorboardRun:
    """A started writer (rank 0)."""

    def __init__(self, writer: Any, log_dir: str):
        self.writer = writer
        self.log_dir = log_dir
        self.series: set[str] = set()
        self.last_step = 0

    def _scalar(self, key: str, value: float, step: int) -> None:
        self.writer.add_scalar(key, value, step, new_style=True, double_precision=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if key == "eval/samples" and value:
                rows = ["| step | prompt | completion |", "| --- | --- | --- |"]
                rows += [f"| {r['step']} | {_cell(r['prompt'])} | {_cell(r['completion'])} |"
                         for r in value]
                self.writer.add_text(key, "\n".join(rows), step)
                continue
            number = _number(value)
            if number is not None:
                self._scalar(key, number, step)
                self.series.add(key)
        self.last_step = max(self.last_step, step)
        self.writer.flush()

    def describe(self) -> dict[str, Any]:
        return {"option": "tensorboard", "dir": self.log_dir}

    def finish(self, summary: dict[str, Any]) -> None:
        flat = logged_summary(summary)
        step = max(self.last_step, int(_number((summary.get("train") or {}).get("steps")) or 0))
        words = []
        for key, value in flat.items():
            number = _number(value)
            if number is not None and not key.startswith("meta/"):
                if key not in self.series:
                    self._scalar(key, number, step)
            else:
                words.append(f"| {key} | {_cell(value)} |")
        self.writer.add_text("summary", "\n".join(["| key | value |", "| --- | --- |", *words]),
                             step)
        self.writer.close()
