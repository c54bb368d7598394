"""`distributed=single`: one process, one device. The shape every distributed option follows:
``world_size()`` before building, ``wrap(model, ctx)`` after PEFT and checkpointing."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from memlab.registry import register


@register("distributed", "single")
@dataclass(kw_only=True)
class Single:
    """No knobs."""

    def world_size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def validate(self, ctx) -> list[str]:
        return []

    def wrap(self, model: nn.Module, ctx) -> nn.Module:
        return model

    def shards_states(self) -> bool:
        """Whether parameters / gradients / optimizer state are sharded across ranks."""
        return False
