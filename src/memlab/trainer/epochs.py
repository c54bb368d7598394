"""``train.epochs``: how many optimizer steps whole passes over the training rows come to.

A pass is the stream's permutation of the prepared rows (after packing; an online method's
prompts), walked in global micro-batches of ``batch_size * processes`` rows
(:class:`memlab.trainer.batch.BatchStream`). As transformers' Trainer counts them (what TRL's
trainers inherit), without ``dataloader_drop_last``:

- the pass's last micro-batch holds the rows left (a partial batch, not dropped), and
- its last optimizer step takes the micro-batches left (fewer than ``grad_accum``),

so a pass is ``ceil(rows / (batch_size * processes * grad_accum))`` steps and trains on every
row once (``ceil(ceil(r / b) / a) == ceil(r / (b * a))``). Dropping the remainder would leave
up to ``batch_size * processes * grad_accum - 1`` rows of every pass untrained, silently. An
online method with ``num_iterations`` k trains k steps on every generation batch (as TRL's GRPO
does), so a pass is k times as many steps. N processes with batch B take the steps one process
with batch N * B takes: they walk the same permutation in the same global batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memlab.config import DEFAULT_STEPS, profile_step_past
from memlab.registry import ConfigErrors

if TYPE_CHECKING:
    from memlab.protocols import BuildContext
    from memlab.trainer.batch import BatchStream


@dataclass(frozen=True)
class StepPlan:
    """The steps a run takes, and how ``train.epochs`` (when set) came to them."""

    steps: int
    """Optimizer steps to run."""
    epochs: int | None = None
    """``train.epochs`` (None: the run counts ``train.steps``)."""
    steps_per_epoch: int | None = None
    """Optimizer steps of one pass over the rows (with ``epochs``)."""
    micro_batches: int | None = None
    """Micro-batches the run draws from its stream (with ``epochs``: every pass's, in full)."""

    @property
    def by_epoch(self) -> bool:
        """Steps end at a pass's end (the last step of a pass may be short)."""
        return self.epochs is not None

    def as_dict(self) -> dict[str, int]:
        """What summary.json's ``train`` records beside ``steps_planned``."""
        if self.epochs is None or self.steps_per_epoch is None:
            return {}
        return {"epochs": self.epochs, "steps_per_epoch": self.steps_per_epoch}


def steps_per_epoch(rows: int, batch_rows: int, grad_accum: int, num_iterations: int = 1) -> int:
    """Optimizer steps of one pass over ``rows`` in micro-batches of ``batch_rows`` (global:
    every process's rows), ``grad_accum`` micro-batches a step, each generation batch trained
    ``num_iterations`` times."""
    micro = math.ceil(rows / max(1, batch_rows))
    return math.ceil(micro / max(1, grad_accum)) * max(1, num_iterations)


def plan(ctx: BuildContext, stream: BatchStream) -> StepPlan:
    """The run's steps: ``train.steps`` (or the default), or ``train.epochs`` passes over
    ``stream``'s rows. A ``measure.profile_step`` past them is a ConfigErrors (with
    ``train.steps`` it is refused before anything builds)."""
    train = ctx.train
    fixed = train.fixed_steps()
    if fixed is not None or train.epochs is None:
        return StepPlan(steps=train.steps or DEFAULT_STEPS)
    online = ctx.method.as_generating()
    per = steps_per_epoch(len(stream.ds), stream.batch_size * stream.world, train.grad_accum,
                          online.num_iterations if online is not None else 1)
    micro = math.ceil(len(stream.ds) / max(1, stream.batch_size * stream.world))
    out = StepPlan(steps=per * train.epochs, epochs=train.epochs, steps_per_epoch=per,
                   micro_batches=micro * train.epochs)
    step = ctx.measure.profile_step
    if step is not None and step >= out.steps:
        raise ConfigErrors([profile_step_past(step, out.steps, train.epochs)])
    return out
