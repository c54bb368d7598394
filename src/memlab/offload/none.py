"""`offload=none`: activations stay on the device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn

from memlab.registry import register


@register("offload", "none")
@dataclass(kw_only=True)
class NoOffload:
    """No knobs."""

    def validate(self, ctx) -> list[str]:
        return []

    def build(self, model: nn.Module, ctx):
        """Returns the per-forward context factory (here: nothing to do)."""
        return None

    @staticmethod
    def forward_context(handle):
        return contextlib.nullcontext()
