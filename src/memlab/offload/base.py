"""What an offload option provides (:class:`Offload`) and the handle the trainer drives
(:class:`OffloadHandle`).

``build(model, ctx, placement)`` returns the run's handle (None: nothing is offloaded);
``forward_context(handle)`` wraps each forward + loss; the trainer calls ``handle.reset()``
after every micro-batch's backward and records ``handle.stats()`` in the summary.
:class:`Placement` says where offloaded tensors go and which tensors are handled: a run keeps
the defaults (host memory, plain tensors); ``memlab estimate`` passes its own (fake tensors,
host copies on another fake device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from torch import nn

from memlab import registry
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


class OffloadHandle(Protocol):
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> None: ...
    def reset(self) -> None: ...
    def stats(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Placement:
    """Where offloaded activations go and which tensors the offloader handles (None: the
    offloader's defaults)."""

    storage: Any = None
    """An :class:`memlab.offload.hooks.OffloadStorage`."""
    key: Any = None
    """``tensor -> hashable``: which storage a tensor views."""
    tensor_types: tuple[type, ...] | None = None


class Offload(Option, Protocol):
    """An ``offload=`` option."""

    def build(self, model: nn.Module, ctx: BuildContext, placement: Placement | None = None
              ) -> OffloadHandle | None:
        """The run's handle on ``model`` (None: nothing is offloaded)."""
        ...

    def forward_context(self, handle: OffloadHandle | None) -> contextlib.AbstractContextManager:
        """Around each forward + loss."""
        ...


OffloadClass = TypeVar("OffloadClass", bound=Offload)


def register(name: str) -> Callable[[type[OffloadClass]], type[OffloadClass]]:
    """Register an ``offload=`` option (mypy checks it against :class:`Offload`)."""
    return registry.register("offload", name)
