"""`precision=auto` (the default): bf16 mixed precision where the device computes in bf16, fp32
where it cannot.

It is TRL's default: ``SFTConfig`` (and every TRL trainer's config) sets ``bf16=True`` unless
fp16 is asked for, and transformers then trains under ``torch.autocast(bfloat16)`` with fp32
weights, on a GPU and on the CPU alike. Here it resolves, once, when the run is validated:

- a CUDA device with bf16 kernels (Ampere and newer): ``bf16_mixed``;
- a CUDA device without them (V100, T4): ``fp32`` (where TRL's default stops with an error);
- the CPU: ``bf16_mixed`` (every torch CPU build autocasts to bf16; measured on this project's
  2-core CPU at Qwen2.5-0.5B's size, a step ran 1.7x faster than in fp32).

The run records the option it resolved to (``summary.json``'s ``config.precision.name``), and
``precision=fp32`` keeps full fp32 compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from memlab.precision.base import Dtypes, Precision, register
from memlab.precision.bf16_mixed import Bf16Mixed
from memlab.precision.fp32 import Fp32

if TYPE_CHECKING:
    from memlab.config import Platform


@register("auto")
@dataclass(kw_only=True)
class Auto(Dtypes):
    """No knobs; :meth:`resolved` picks the option."""

    param_dtype: ClassVar[str] = "float32"
    autocast_dtype: ClassVar[str | None] = None
    needs_scaler: ClassVar[bool] = False
    cuda_only: ClassVar[bool] = False

    def resolved(self, device: str, platform: Platform) -> Precision:
        if device.startswith("cuda") and not platform.bf16:
            return Fp32()
        return Bf16Mixed()
