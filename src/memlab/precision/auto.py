"""`precision=auto` (the default): bf16 mixed precision where the device has bf16 kernels, fp32
where it has not.

TRL's default is bf16 mixed everywhere: ``SFTConfig`` (every TRL trainer's config) sets
``bf16=True`` unless fp16 is asked for, and transformers then trains under
``torch.autocast(bfloat16)`` with fp32 weights, on a GPU and on a CPU alike. memlab's default
takes it where it is fast and keeps fp32 where bf16 would be emulated. It resolves once, when
the run is validated:

- a CUDA device with bf16 kernels (Ampere and newer): ``bf16_mixed``;
- a CUDA device without them (V100, T4): ``fp32`` (where TRL's default stops with an error);
- a CPU with oneDNN's bf16 kernels (AVX-512 or AMX on x86, BF16 on Arm): ``bf16_mixed``;
- any other CPU: ``fp32``. On an AVX2-only CPU a bf16 matmul of Qwen2.5-0.5B's MLP shape took
  17 s against 0.29 s in fp32 (torch 2.13; TRL's default trains so there).

The run records the option it resolved to (``summary.json``'s ``resolved.precision``), and
``precision=fp32`` keeps full fp32 compute. ``MEMLAB_CPU_BF16=1`` / ``0`` overrides the CPU's
detection (a run that must not depend on the machine: the test suite, a benchmark repeated on
other CPUs); summary.json records it (``device.cpu_bf16_env``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memlab import faults
from memlab.precision.base import Dtypes, Precision, register
from memlab.precision.bf16_mixed import Bf16Mixed
from memlab.precision.fp32 import Fp32

if TYPE_CHECKING:
    from memlab.config import Platform


@register("auto")
@dataclass(kw_only=True)
class Auto(Dtypes):
    """No knobs; :meth:`resolved` picks the option (the dtypes are :class:`Dtypes`' defaults,
    never read: a run sees the resolved option)."""

    def resolved(self, device: str, platform: Platform) -> Precision:
        has_bf16 = platform.bf16 if device.startswith("cuda") else platform.cpu_bf16
        option: Precision = Bf16Mixed() if has_bf16 else Fp32()
        if platform.detected and not (not device.startswith("cuda") and platform.cpu_bf16_env):
            faults.note(f"precision=auto -> {option.name}")  # this machine decided (tests' guard)
        return option
