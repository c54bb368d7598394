"""What every distributed option shares, and the two helpers methods use to stay correct under
any wrapper.

An option (``distributed=<name>``) is a registered dataclass with:

- ``processes(device) -> int``: processes this run needs (1 = this process trains;
  more = ``memlab.distributed.launch`` starts that many workers, one per rank);
- ``validate(ctx) -> list[str]``;
- ``setup(ctx)`` / ``teardown()``: the process group of a worker;
- ``wrap(model, ctx) -> nn.Module``: after PEFT, checkpointing and offload hooks;
- ``sync(model, last) -> context``: gradient synchronisation for one micro-batch (DDP skips it
  on all but the last micro-batch of a step);
- ``all_reduce_sum(values, device) -> list[float]``: sums numbers over the ranks (loss items,
  logged metrics);
- ``describe(model) -> dict``: the wrapper's own buffers for the summary (DDP's buckets);
- ``shards_states() -> bool``.

Methods call the policy as ``model(**inputs)``. When they need only part of it (the decoder's
hidden states for a chunked / fused loss, a reward head on packed rows), they go through
``call_inside``, so the part still runs inside the wrapper's forward: DDP prepares its gradient
reduction in its forward, and a forward that bypasses it would break or skip the all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn


class Routed(nn.Module):
    """The module a distributed wrapper wraps: calls the model, or - with ``memlab_call`` -
    runs ``memlab_call(model, *args, **kwargs)`` instead, inside the wrapper's forward."""

    memlab_routed = True

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model  # ``.module`` like DDP's, so ``unwrap`` goes through both

    def forward(self, *args: Any, memlab_call: Callable | None = None, **kwargs: Any) -> Any:
        if memlab_call is not None:
            return memlab_call(self.module, *args, **kwargs)
        return self.module(*args, **kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """Through distributed wrappers (``.module``) to the model (PeftModel or plain)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def call_inside(model: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(unwrapped_model, *args, **kwargs)``, run inside the distributed wrapper's forward
    when there is one."""
    inner = getattr(model, "module", None)
    if isinstance(inner, Routed):
        return model(*args, memlab_call=fn, **kwargs)
    return fn(unwrap(model), *args, **kwargs)


def no_context(*_: Any, **__: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()
