"""`precision=bf16`: Weights, gradients, optimizer state and compute all in bf16 (no fp32 master copy): half the parameter bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.precision.base import Dtypes, register


@register("bf16")
@dataclass(kw_only=True)
class Bf16(Dtypes):
    """No knobs."""

    param_dtype: ClassVar[str] = "bfloat16"
    autocast_dtype: ClassVar[str | None] = None
    needs_scaler: ClassVar[bool] = False
    cuda_only: ClassVar[bool] = False
