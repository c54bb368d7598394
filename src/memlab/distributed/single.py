"""`distributed=single`: one process, one device. See ``memlab.distributed.base`` for the shape
every distributed option follows."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from memlab.distributed.base import NoCapabilities, OptimizerTensors, Sharding, register
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("single")
@dataclass(kw_only=True)
class Single(NoCapabilities, Option):
    """No knobs."""

    wraps_fake_tensors: ClassVar[bool] = True
    reduces_before_grad_hooks: ClassVar[bool] = True

    def processes(self, device: str, gpus: int = 0) -> int:
        return 1

    def validate(self, ctx: BuildContext) -> list[str]:
        return []

    def setup(self, ctx: BuildContext) -> None:
        return None

    def teardown(self) -> None:
        return None

    def wrap(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        return model

    def sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def all_reduce_sum(self, values: list[float], device: str) -> list[float]:
        return list(values)

    def generation(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def gathered(self, param: torch.Tensor) -> contextlib.AbstractContextManager[torch.Tensor]:
        return contextlib.nullcontext(param)

    def memory_roles(self, model: nn.Module) -> dict[str, list[torch.Tensor]]:
        return {}

    def describe(self, model: nn.Module) -> dict[str, Any]:
        """Buffers the wrapper itself holds (none here)."""
        return {}

    def on_fake_group(self, ctx: BuildContext) -> contextlib.AbstractContextManager[list[str]]:
        """No process group: nothing to add."""
        return contextlib.nullcontext([])

    def optimizer_tensors(self, ctx: BuildContext) -> OptimizerTensors:
        return "parameters"

    def sharding(self) -> Sharding | None:
        """One plain process: nothing to shard."""
        return None
