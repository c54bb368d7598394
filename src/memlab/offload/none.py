"""`offload=none`: activations stay on the device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn

from memlab.offload.base import Placement
from memlab.registry import register


@register("offload", "none")
@dataclass(kw_only=True)
class NoOffload:
    """No knobs."""

    def validate(self, ctx) -> list[str]:
        return []

    def build(self, model: nn.Module, ctx, placement: Placement | None = None) -> None:
        """Nothing is offloaded: no handle."""
        return None

    @staticmethod
    def forward_context(handle):
        return contextlib.nullcontext()
