"""What a peft option provides: load arguments for the base model (a quantization config),
adapters applied to the loaded model, and what it declares."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from torch import nn


class Peft(Protocol):
    """A ``peft=`` option."""

    quantizes_base: ClassVar[bool]
    """The frozen base is stored quantized (it cannot be merged with the adapters)."""

    def validate(self, ctx) -> list[str]: ...

    def load_kwargs(self, ctx) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments (qlora: the bitsandbytes config)."""
        ...

    def apply(self, model: nn.Module, ctx, task: str) -> nn.Module:
        """The model with adapters (the model itself for full fine-tuning)."""
        ...

    def has_adapter(self) -> bool:
        """Whether the trained parameters are adapters (the base can be switched off)."""
        ...
