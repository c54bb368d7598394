"""`peft=none`: full fine-tuning; every parameter trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from memlab.registry import register


@register("peft", "none")
@dataclass(kw_only=True)
class NoPeft:
    """No knobs."""

    quantizes_base: ClassVar[bool] = False
    """The frozen base is stored quantized (bitsandbytes): it cannot be merged with adapters."""

    def validate(self, ctx) -> list[str]:
        return []

    def load_kwargs(self, ctx) -> dict[str, Any]:
        return {}

    def apply(self, model: nn.Module, ctx, task: str) -> nn.Module:
        return model

    def has_adapter(self) -> bool:
        return False
