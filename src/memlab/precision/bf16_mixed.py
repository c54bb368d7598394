"""`precision=bf16_mixed`: fp32 master weights, forward/backward under torch.autocast(bf16)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.precision.base import Mixed, register


@register("bf16_mixed")
@dataclass(kw_only=True)
class Bf16Mixed(Mixed):
    """The knob is :class:`Mixed`'s."""

    param_dtype: ClassVar[str] = "float32"
    autocast_dtype: ClassVar[str | None] = "bfloat16"
    needs_scaler: ClassVar[bool] = False
    cuda_only: ClassVar[bool] = False
