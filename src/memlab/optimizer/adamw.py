"""`optimizer=adamw`: torch's AdamW with fp32 moments (TRL's ``optim="adamw_torch"``, the
default): two states the size of the trainable parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import torch
from torch import nn

from memlab.optimizer.base import OptimizerKnobs, register
from memlab.registry import PositiveFloat, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext

Beta = Annotated[float, Range(ge=0, lt=1)]


@register("adamw")
@dataclass(kw_only=True)
class AdamW(OptimizerKnobs):
    """``torch.optim.AdamW`` (decoupled weight decay: ``train.weight_decay``)."""

    betas: list[Beta] = field(default_factory=lambda: [0.9, 0.999])
    """(beta1, beta2): the decay of the first and second moments (TRL's ``adam_beta1`` /
    ``adam_beta2``)."""
    eps: PositiveFloat = 1e-8
    """Added to the second moment's square root (TRL's ``adam_epsilon``)."""
    fused: bool = True
    """torch's fused kernel (CPU and CUDA; TRL's default, as transformers picks
    ``optim="adamw_torch_fused"`` with torch >= 2.8): each parameter updated in one pass,
    without the parameter-sized temporaries of torch's other implementations (two for the
    largest parameter on CPU; one with ``in_backward``). The same update up to float rounding.
    false: torch's default implementation (the multi-tensor one on CUDA, the single-tensor loop
    on CPU; TRL's ``optim="adamw_torch"``). ``memlab estimate``'s two shallow builds give the
    fused step's bytes exactly on CPU; on the CUDA model the optimizer phase's temporaries are
    512 B short per ~100 parameters beyond 8 layers (1 KB at Qwen2.5-0.5B's 24; the peak, in
    the backward, is exact)."""

    def validate(self, ctx: BuildContext) -> list[str]:
        return beta_errors(self.betas) + super().validate(ctx)

    def build(self, params: list[nn.Parameter], ctx: BuildContext,
              model: nn.Module | None = None, foreach: bool | None = None
              ) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=ctx.train.lr, betas=(self.betas[0], self.betas[1]),
                                 eps=self.eps, weight_decay=ctx.train.weight_decay,
                                 foreach=None if self.fused else foreach,
                                 fused=True if self.fused else None)

    def group_settings(self) -> dict[str, Any]:
        return {"betas": tuple(self.betas), "eps": self.eps}


def beta_errors(betas: list[float]) -> list[str]:
    """``optimizer.betas`` must be two numbers."""
    if len(betas) != 2:
        return [f"optimizer.betas must be two numbers [beta1, beta2] (got {betas})"]
    return []
