"""`offload=none`: activations stay on the device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from memlab.offload.base import Placement, register
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("none")
@dataclass(kw_only=True)
class NoOffload(Option):
    """No knobs."""

    def validate(self, ctx: BuildContext) -> list[str]:
        return []

    def build(self, model: nn.Module, ctx: BuildContext, placement: Placement | None = None
              ) -> None:
        """Nothing is offloaded: no handle."""
        return None

    @staticmethod
    def forward_context(handle):
        return contextlib.nullcontext()
