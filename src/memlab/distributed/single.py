"""`distributed=single`: one process, one device. See ``memlab.distributed.base`` for the shape
every distributed option follows."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from memlab.distributed._replica import Replica
from memlab.distributed.base import NoCapabilities, Sharding, register
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("single")
@dataclass(kw_only=True)
class Single(Replica, NoCapabilities, Option):
    """No knobs; a replica's answers (:class:`memlab.distributed._replica.Replica`)."""

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

    def describe(self, model: nn.Module) -> dict[str, Any]:
        """Buffers the wrapper itself holds (none here)."""
        return {}

    def sharding(self) -> Sharding | None:
        """One plain process: nothing to shard."""
        return None
