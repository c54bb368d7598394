"""`optimizer=adafactor`: transformers' Adafactor (TRL's ``optim="adafactor"``, set up as the
Trainer does: ``relative_step=False``, ``scale_parameter=False``, so memlab's learning rate and
schedule apply). Its second moment of a matrix is factored into a row and a column vector; with
``beta1`` null (the default) it keeps no first moment: the state of an ``[m, n]`` weight is
``m + n`` numbers instead of AdamW's ``2 m n``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch
from torch import nn

from memlab.optimizer.base import OptimizerKnobs, register
from memlab.registry import PositiveFloat, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("adafactor")
@dataclass(kw_only=True)
class Adafactor(OptimizerKnobs):
    """``transformers.optimization.Adafactor`` with an external learning rate."""

    eps: list[PositiveFloat] = field(default_factory=lambda: [1e-30, 1e-3])
    """(eps1, eps2): added to the squared gradient, and the floor of a parameter's scale."""
    clip_threshold: PositiveFloat = 1.0
    """The update's root-mean-square is clipped to this, per tensor."""
    decay_rate: Annotated[float, Range(lt=0)] = -0.8
    """The second moment's decay: ``beta2_t = 1 - t ** decay_rate``."""
    beta1: Annotated[float, Range(ge=0, lt=1)] | None = None
    """A first moment with this decay (one more parameter-sized state); null: none."""

    takes_flat_partitions: ClassVar[bool] = False

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if len(self.eps) != 2:
            errors.append(f"optimizer.eps must be two numbers [eps1, eps2] (got {self.eps})")
        return errors

    def flat_reason(self) -> str:
        return ("Adafactor factors the second moment of each 2-D weight and clips each tensor's "
                "update by its own RMS; on a flat partition it would keep a full second moment "
                "and clip across parameters (another algorithm)")

    def build(self, params: list[nn.Parameter], ctx: BuildContext,
              model: nn.Module | None = None, foreach: bool | None = None
              ) -> torch.optim.Optimizer:
        from transformers.optimization import Adafactor as HFAdafactor

        return HFAdafactor(params, lr=ctx.train.lr, eps=(self.eps[0], self.eps[1]),
                           clip_threshold=self.clip_threshold, decay_rate=self.decay_rate,
                           beta1=self.beta1, weight_decay=ctx.train.weight_decay,
                           scale_parameter=False, relative_step=False, warmup_init=False)

    def group_settings(self) -> dict[str, Any]:
        return {"eps": tuple(self.eps), "clip_threshold": self.clip_threshold,
                "decay_rate": self.decay_rate, "beta1": self.beta1}
