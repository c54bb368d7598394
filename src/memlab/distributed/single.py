"""`distributed=single`: one process, one device. See ``memlab.distributed.base`` for the shape
every distributed option follows."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from memlab.registry import register


@register("distributed", "single")
@dataclass(kw_only=True)
class Single:
    """No knobs."""

    owns_step: ClassVar[bool] = False
    checkpoint_format: ClassVar[str] = "torch"
    wraps_fake_tensors: ClassVar[bool] = True

    def processes(self, device: str, gpus: int = 0) -> int:
        return 1

    def validate(self, ctx) -> list[str]:
        return []

    def setup(self, ctx) -> None:
        return None

    def teardown(self) -> None:
        return None

    def wrap(self, model: nn.Module, ctx) -> nn.Module:
        return model

    def sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def all_reduce_sum(self, values: list[float], device: str) -> list[float]:
        return list(values)

    def generation(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def memory_roles(self, model: nn.Module) -> dict[str, list[torch.Tensor]]:
        return {}

    def describe(self, model: nn.Module) -> dict:
        """Buffers the wrapper itself holds (none here)."""
        return {}

    def on_fake_group(self, ctx) -> contextlib.AbstractContextManager[list[str]]:
        """No process group: nothing to add."""
        return contextlib.nullcontext([])

    def shards_states(self) -> bool:
        """Whether parameters / gradients / optimizer state are sharded across ranks."""
        return False
