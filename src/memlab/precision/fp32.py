"""`precision=fp32`: Full fp32 weights and compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.precision.base import Dtypes, register


@register("fp32")
@dataclass(kw_only=True)
class Fp32(Dtypes):
    """No knobs."""

    param_dtype: ClassVar[str] = "float32"
    autocast_dtype: ClassVar[str | None] = None
    needs_scaler: ClassVar[bool] = False
    cuda_only: ClassVar[bool] = False
