"""What a peft option provides: load arguments for the base model (a quantization config),
adapters applied to the loaded model, and what it declares."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from torch import nn

from memlab import registry
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.model.base import Head


class QuantizedBase(Protocol):
    """A peft option that stores the frozen base quantized by bitsandbytes (it cannot be merged
    with the adapters): how (read by ``memlab estimate``, which lays the base out the same)."""

    @property
    def bits(self) -> Literal[4, 8]: ...
    @property
    def quant_type(self) -> str: ...
    @property
    def double_quant(self) -> bool: ...
    @property
    def compute_dtype(self) -> str: ...


class Peft(Option, Protocol):
    """A ``peft=`` option."""

    def load_kwargs(self, ctx: BuildContext) -> dict[str, Any]:
        """Extra ``from_pretrained`` arguments (qlora: the bitsandbytes config)."""
        ...

    def apply(self, model: nn.Module, ctx: BuildContext, task: Head) -> nn.Module:
        """The model with adapters (the model itself for full fine-tuning)."""
        ...

    def has_adapter(self) -> bool:
        """Whether the trained parameters are adapters (the base can be switched off)."""
        ...

    def adapts_head(self) -> bool:
        """Whether an adapter sits on the output head (``lm_head``): a loss that reads the
        head's weight directly would leave it out."""
        ...

    def as_quantized_base(self) -> QuantizedBase | None:
        """The option as one whose frozen base is stored quantized, or None."""
        ...


PeftClass = TypeVar("PeftClass", bound=Peft)


def register(name: str) -> Callable[[type[PeftClass]], type[PeftClass]]:
    """Register a ``peft=`` option (mypy checks it against :class:`Peft`)."""
    return registry.register("peft", name)
