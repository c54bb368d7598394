"""What a peft option provides (:class:`Peft`, with :class:`QuantizedBase`: in
:mod:`memlab.protocols`, re-exported here): load arguments for the base model (a quantization
config), adapters applied to the loaded model, and what it declares."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from memlab import registry
from memlab.protocols import Peft
from memlab.protocols import QuantizedBase as QuantizedBase

PeftClass = TypeVar("PeftClass", bound=Peft)


def register(name: str) -> Callable[[type[PeftClass]], type[PeftClass]]:
    """Register a ``peft=`` option (mypy checks it against :class:`Peft`)."""
    return registry.register("peft", name)
