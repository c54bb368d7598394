"""`peft=none`: full fine-tuning; every parameter trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from memlab.peft.base import QuantizedBase, register
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("none")
@dataclass(kw_only=True)
class NoPeft(Option):
    """No knobs."""

    def validate(self, ctx: BuildContext) -> list[str]:
        return []

    def load_kwargs(self, ctx: BuildContext) -> dict[str, Any]:
        return {}

    def apply(self, model: nn.Module, ctx: BuildContext, task: str) -> nn.Module:
        return model

    def as_quantized_base(self) -> QuantizedBase | None:
        return None

    def has_adapter(self) -> bool:
        return False

    def adapts_head(self) -> bool:
        return False
