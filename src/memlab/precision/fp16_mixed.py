"""`precision=fp16_mixed`: fp32 master weights, autocast(fp16) with a GradScaler. CUDA only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.precision.base import Mixed, register


@register("fp16_mixed")
@dataclass(kw_only=True)
class Fp16Mixed(Mixed):
    """The knob is :class:`Mixed`'s."""

    param_dtype: ClassVar[str] = "float32"
    autocast_dtype: ClassVar[str | None] = "float16"
    needs_scaler: ClassVar[bool] = True
    cuda_only: ClassVar[bool] = True
