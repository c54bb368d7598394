"""How the loop and the methods reach the model through a distributed wrapper.

Methods call the policy as ``model(**inputs)``. When they need only part of it (the decoder's
hidden states for a chunked / fused loss, a reward head on packed rows), they go through
:func:`call_inside`, so the part still runs inside the wrapper's forward: DDP prepares its
gradient reduction in its forward, and a forward that bypasses it would break or skip the
all-reduce. Wrappers wrap a :class:`Routed` module for that reason.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

HFModel: TypeAlias = "PreTrainedModel | PeftModel"
"""What :func:`unwrap` finds inside the wrappers: the transformers model memlab loaded, or the
PEFT model around it."""


class Routed(nn.Module):
    """The module a distributed wrapper wraps: calls the model, or - with ``memlab_call`` -
    runs ``memlab_call(model, *args, **kwargs)`` instead, inside the wrapper's forward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model  # ``.module`` like DDP's, so ``unwrap`` goes through both

    def forward(self, *args: Any, memlab_call: Callable | None = None, **kwargs: Any) -> Any:
        if memlab_call is not None:
            return memlab_call(self.module, *args, **kwargs)
        return self.module(*args, **kwargs)


def unwrap(model: nn.Module) -> HFModel:
    """Through distributed wrappers (``.module``) to the model (PeftModel or plain)."""
    while isinstance(inner := getattr(model, "module", None), nn.Module):
        model = inner
    return cast("HFModel", model)  # every model memlab builds is one


def base_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper (the model itself when there is none).

    Without ``peft`` imported no model can be a PeftModel, so a run without an adapter does not
    pay peft's import (0.4 s, on every estimate too)."""
    peft = sys.modules.get("peft")
    is_peft = peft is not None and isinstance(model, peft.PeftModel)
    return cast("PreTrainedModel", cast("PeftModel", model).get_base_model() if is_peft
                else model)


def call_inside(model: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(unwrapped_model, *args, **kwargs)``, run inside the distributed wrapper's forward
    when there is one (DDP around a Routed, or a Routed that FSDP2 made its root)."""
    if isinstance(model, Routed) or isinstance(getattr(model, "module", None), Routed):
        return model(*args, memlab_call=fn, **kwargs)
    return fn(unwrap(model), *args, **kwargs)
