"""`optimizer=sgd`: torch's SGD (TRL's ``optim="sgd"``): no state without momentum, one
parameter-sized buffer with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memlab.optimizer.base import OptimizerKnobs, register
from memlab.registry import Fraction

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("sgd")
@dataclass(kw_only=True)
class SGD(OptimizerKnobs):
    """``torch.optim.SGD`` (weight decay: ``train.weight_decay``, added to the gradient)."""

    momentum: Fraction = 0.0
    """0: plain SGD, no state; > 0: one momentum buffer per parameter."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0)."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if self.nesterov and self.momentum <= 0:
            errors.append("optimizer.nesterov=true needs optimizer.momentum > 0 (e.g. "
                          "optimizer.momentum=0.9)")
        return errors

    def build(self, params: list[nn.Parameter], ctx: BuildContext,
              model: nn.Module | None = None, foreach: bool | None = None
              ) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=ctx.train.lr, momentum=self.momentum,
                               nesterov=self.nesterov, weight_decay=ctx.train.weight_decay,
                               foreach=foreach)

    def group_settings(self) -> dict[str, Any]:
        return {"momentum": self.momentum, "nesterov": self.nesterov}
