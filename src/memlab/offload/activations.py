"""`offload=activations`: tensors saved for backward move to (pinned) host memory during the
forward pass and come back for backward (saved-tensor hooks; on CUDA the copies overlap compute
on side streams). Parameters, small tensors and the LM head's output stay on the device.
Combines with gradient checkpointing: then only what checkpointing still saves (the layer
inputs) is offloaded. See memlab/offload/hooks.py for the mechanics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from memlab.offload.base import Placement, register
from memlab.offload.hooks import ActivationOffloader
from memlab.registry import NonNegativeInt, Option
from memlab.trainer.routing import unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("activations")
@dataclass(kw_only=True)
class Activations(Option):
    """Offloading knobs."""

    min_bytes: NonNegativeInt = 1 << 20
    """Tensors smaller than this stay on the device (copies of tiny tensors cost more than they
    save)."""
    use_streams: bool = True
    """CUDA: copy on side streams overlapping compute (false: synchronous copies)."""
    pin_memory: bool = True
    """CUDA: pinned host buffers (faster, asynchronous copies)."""
    prefetch: NonNegativeInt = 2
    """Backward: how many offloaded tensors are brought back ahead of use."""
    allow_cpu: bool = False
    """On CPU activations already live in host memory, so offloading saves nothing; true runs
    the hooks anyway (to test the mechanics)."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = []
        if not ctx.is_cuda and not self.allow_cpu:
            errors.append(
                "offload=activations moves activations from GPU memory to host memory; on a CPU "
                "run they already live in host memory, so there is nothing to save. Run on CUDA, "
                "or set offload.allow_cpu=true to exercise the hooks on CPU (no memory saved)"
            )
        if self.min_bytes < 0 or self.prefetch < 0:
            errors.append("offload.min_bytes and offload.prefetch must be >= 0")
        return errors

    def build(self, model: nn.Module, ctx: BuildContext, placement: Placement | None = None
              ) -> ActivationOffloader:
        """The offloader for ``model`` (one per run; the trainer resets it every micro-batch)."""
        placement = placement or Placement()
        extra: dict[str, Any] = {k: v for k, v in (("storage", placement.storage),
                                                   ("key", placement.key),
                                                   ("tensor_types", placement.tensor_types))
                                 if v is not None}
        off = ActivationOffloader.for_model(
            model, device=ctx.device, min_bytes=self.min_bytes, use_streams=self.use_streams,
            pin_memory=self.pin_memory, prefetch=self.prefetch, **extra,
        )
        head = unwrap(model).get_output_embeddings()
        if head is not None:
            off.exclude_outputs_of(head)
        return off

    @staticmethod
    def forward_context(handle):
        return handle
