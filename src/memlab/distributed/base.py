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

Optional hooks, for a wrapper that owns more of the step (``deepspeed``'s engine):

- ``optimizer(model) -> torch optimizer``, ``backward(model, loss)``,
  ``step(model) -> grad norm``: the trainer then calls these instead of its own optimizer,
  ``loss.backward()`` and clipping (its LR schedule drives the returned torch optimizer);
- ``memory_roles(model) -> {category: [tensors]}``: the wrapper's own buffers (partitions,
  master weights), categorised for the memory tracker at every tracked step and phase;
- ``generation(model) -> context``: around an online method's ``generate`` (gather the
  partitioned weights once);
- ``save_states(model, dir)`` / ``load_states(model, dir)`` / ``full_weights(model)``:
  checkpoints in the wrapper's own sharded format, plus the whole trainable weights.

Methods call the policy as ``model(**inputs)``. When they need only part of it (the decoder's
hidden states for a chunked / fused loss, a reward head on packed rows), they go through
``call_inside``, so the part still runs inside the wrapper's forward: DDP prepares its gradient
reduction in its forward, and a forward that bypasses it would break or skip the all-reduce.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
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
    when there is one (DDP around a Routed, or a Routed that FSDP2 made its root)."""
    if isinstance(model, Routed) or isinstance(getattr(model, "module", None), Routed):
        return model(*args, memlab_call=fn, **kwargs)
    return fn(unwrap(model), *args, **kwargs)


def env_rank() -> tuple[int, int, int]:
    """(rank, local rank, world size) of this process: from memlab's launcher, else from an
    external one (torchrun sets RANK / LOCAL_RANK / WORLD_SIZE)."""
    env = os.environ
    if "MEMLAB_RANK" in env:
        return (int(env["MEMLAB_RANK"]), int(env.get("MEMLAB_LOCAL_RANK", 0)),
                int(env.get("MEMLAB_WORLD_SIZE", 1)))
    return (int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)),
            int(env.get("WORLD_SIZE", 1)))


def external_launch() -> bool:
    """Whether this process is one rank of several started by an external launcher (torchrun,
    possibly across nodes) rather than by memlab."""
    return "MEMLAB_RANK" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(kw_only=True)
class Ranks:
    """What every multi-process option shares: how many ranks, the process group, sums."""

    nproc: int | None = None
    """Ranks on this machine. None: one per visible GPU on CUDA, 2 on CPU."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on CUDA, gloo on CPU."""
    timeout_s: int = 1800
    """How long a rank waits in a collective before the run fails (a dead peer)."""
    master_port: int = 0
    """Rendezvous port on 127.0.0.1; 0 picks a free one."""

    def processes(self, device: str) -> int:
        if self.nproc is not None:
            return self.nproc
        if device.startswith("cuda") and torch.cuda.is_available():
            return max(1, torch.cuda.device_count())
        return 2

    def backend_for(self, device: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.startswith("cuda") else "gloo"

    def validate(self, ctx) -> list[str]:
        errors = []
        n = self.processes(ctx.device)
        if n < 1:
            errors.append(f"distributed.nproc must be >= 1 (got {n})")
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if ctx.is_cuda and visible and n > visible:  # none visible: checked for another machine
            errors.append(f"distributed.nproc={n} but {visible} CUDA device(s) are visible; "
                          f"set distributed.nproc<={visible} (one rank per GPU)")
        if self.backend_for(ctx.device) == "nccl" and not ctx.is_cuda:
            errors.append("distributed.backend=nccl needs CUDA devices; use "
                          "distributed.backend=gloo (or auto) on CPU")
        if not torch.distributed.is_available():
            errors.append("this torch build has no torch.distributed; use distributed=single")
        return errors

    def setup(self, ctx) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            return
        _, local, _ = env_rank()
        if ctx.is_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(self.backend_for(ctx.device), rank=ctx.rank,
                                world_size=ctx.world_size,
                                timeout=timedelta(seconds=self.timeout_s))

    def teardown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce_sum(self, values: list[float], device: str) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64,
                         device=device if self.backend_for(device) == "nccl" else "cpu")
        dist.all_reduce(t)
        return t.tolist()


def no_context(*_: Any, **__: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()
