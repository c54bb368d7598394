"""`optimizer=paged_adamw_8bit`: ``adamw_8bit`` whose states of 100k elements or more live in
CUDA unified memory (TRL's ``optim="paged_adamw_8bit"``): the driver pages them out to the host
when the GPU runs short, instead of failing. CUDA only: on a CPU run bitsandbytes falls back to
unpaged states, which is ``optimizer=adamw_8bit``, so memlab refuses it there.

Unified memory is not PyTorch's allocator: on a GPU the paged states are absent from
``torch.cuda.max_memory_allocated`` (and from the tracker's ``optimizer`` category, which sees
them as tensors, the upper bound ``memlab estimate`` reports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from memlab.optimizer._bnb import AdamW8bitKnobs
from memlab.optimizer.base import register

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("paged_adamw_8bit")
@dataclass(kw_only=True)
class PagedAdamW8bit(AdamW8bitKnobs):
    """bitsandbytes' ``AdamW(optim_bits=8, is_paged=True)``."""

    paged: ClassVar[bool] = True

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if not ctx.is_cuda:
            errors.append("optimizer=paged_adamw_8bit pages its states through CUDA unified "
                          f"memory, and this run is on {ctx.device}, where bitsandbytes keeps "
                          "them unpaged (optimizer=adamw_8bit); use optimizer=adamw_8bit")
        return errors
