"""What a precision option provides to the model loader and the trainer (:class:`Precision`, in
:mod:`memlab.protocols` and re-exported here), and the one shape every option shares
(:class:`Dtypes`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch

from memlab import registry
from memlab.protocols import Precision
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.config import Platform
    from memlab.protocols import BuildContext

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


PrecisionClass = TypeVar("PrecisionClass", bound=Precision)


def register(name: str) -> Callable[[type[PrecisionClass]], type[PrecisionClass]]:
    """Register a ``precision=`` option (mypy checks it against :class:`Precision`)."""
    return registry.register("precision", name)


@dataclass(kw_only=True)
class Dtypes(Option):
    """Every precision option is this shape, set by four class-level flags:
    ``param_dtype``: dtype weights are loaded in; ``autocast_dtype``: compute dtype under
    torch.autocast (None = no autocast); ``needs_scaler``: fp16 loss scaling."""

    param_dtype: ClassVar[str] = "float32"
    autocast_dtype: ClassVar[str | None] = None
    needs_scaler: ClassVar[bool] = False
    cuda_only: ClassVar[bool] = False

    def torch_param_dtype(self) -> torch.dtype:
        return _DTYPES[self.param_dtype]

    def compute_dtype_name(self) -> str:
        return self.autocast_dtype or self.param_dtype

    def autocast(self, device: str) -> contextlib.AbstractContextManager:
        """Context manager for the forward pass and loss: none here (a precision with a compute
        dtype under autocast is a :class:`Mixed`, which runs the forward under it)."""
        assert self.autocast_dtype is None, f"{type(self).__name__} has an autocast dtype: a Mixed"
        return contextlib.nullcontext()

    def grad_scaler(self, device: str) -> torch.amp.GradScaler | None:
        """A GradScaler for fp16 mixed precision, else None."""
        if not self.needs_scaler:
            return None
        return torch.amp.GradScaler(device.split(":")[0])

    def resolved(self, device: str, platform: Platform) -> Precision:
        return self

    def validate(self, ctx: BuildContext) -> list[str]:
        name = self.name
        if self.cuda_only and not ctx.is_cuda:
            return [
                f"precision={name} needs a CUDA device (fp16 matmuls and loss scaling are not "
                "supported for CPU training); on CPU use precision=fp32, bf16 or bf16_mixed"
            ]
        if ctx.is_cuda and "bfloat16" in (self.param_dtype, self.autocast_dtype):
            if not ctx.platform.bf16:
                return [f"precision={name}: this GPU has no bf16 support; use fp16_mixed"]
        return []


@dataclass(kw_only=True)
class Mixed(Dtypes):
    """A mixed precision (``bf16_mixed``, ``fp16_mixed``): fp32 weights, the forward under
    ``torch.autocast``."""

    autocast_cache: bool = False
    """Keep autocast's low-precision copy of each trained weight until the forward ends (torch's
    ``cache_enabled``, true in torch and TRL). false casts a weight again at each use: the same
    numbers bit for bit. Under gradient checkpointing the cached copies (2 bytes per trained
    parameter) are the only thing a checkpointed layer leaves alive through the forward; without
    checkpointing each copy is saved for the backward either way, so the peak is the same. true
    saves one cast per reuse of a weight inside one forward (none in memlab's methods)."""

    def autocast(self, device: str) -> contextlib.AbstractContextManager:
        assert self.autocast_dtype is not None
        return torch.autocast(device_type=device.split(":")[0],
                              dtype=_DTYPES[self.autocast_dtype],
                              cache_enabled=self.autocast_cache)
