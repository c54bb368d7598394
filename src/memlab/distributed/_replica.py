"""The answers of an option whose every process holds the whole model (``single``, and the
replicated ranks of ``ddp``, through :class:`memlab.distributed.base.Ranks`, which ``fsdp2``
and ``deepspeed`` extend and override where they shard): nothing to gather, nothing of the
wrapper's own to categorise, the optimizer steps the model's own parameters, nothing to add
on a fake process group.

Not an option of its own (the registry skips modules whose name starts with ``_``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from memlab.protocols import BuildContext, OptimizerTensors


class Replica:
    """Mixed into the configs of the options whose processes each hold the whole model."""

    def generation(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Nothing to gather for a whole model."""
        return contextlib.nullcontext()

    def gathered(self, param: torch.Tensor) -> contextlib.AbstractContextManager[torch.Tensor]:
        """A replica's parameter is whole already."""
        return contextlib.nullcontext(param)

    def memory_roles(self, model: nn.Module) -> dict[str, list[torch.Tensor]]:
        """No buffers of the wrapper's own to categorise."""
        return {}

    def optimizer_tensors(self, ctx: BuildContext) -> OptimizerTensors:
        """A replica's optimizer steps the model's own parameters."""
        return "parameters"

    def on_fake_group(self, ctx: BuildContext) -> contextlib.AbstractContextManager[list[str]]:
        """Nothing to add: the model is whole on a fake process group as on a real one."""
        return contextlib.nullcontext([])
