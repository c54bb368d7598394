"""What an offload option provides (:class:`Offload`) and the handle the trainer drives
(:class:`OffloadHandle`).

``build(model, ctx, placement)`` returns the run's handle (None: nothing is offloaded);
``forward_context(handle)`` wraps each forward + loss; the trainer calls ``handle.reset()``
after every micro-batch's backward and records ``handle.stats()`` in the summary.
:class:`Placement` says where offloaded tensors go and which tensors are handled: a run keeps
the defaults (host memory, plain tensors); ``memlab estimate`` passes its own (fake tensors,
host copies on another fake device). The three are in :mod:`memlab.protocols`, re-exported
here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from memlab import registry
from memlab.protocols import Offload
from memlab.protocols import OffloadHandle as OffloadHandle
from memlab.protocols import Placement as Placement

OffloadClass = TypeVar("OffloadClass", bound=Offload)


def register(name: str) -> Callable[[type[OffloadClass]], type[OffloadClass]]:
    """Register an ``offload=`` option (mypy checks it against :class:`Offload`)."""
    return registry.register("offload", name)
