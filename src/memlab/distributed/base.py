"""What every distributed option provides (:class:`Distributed`), what only some provide (their
own small Protocols, asked for through ``as_<capability>()``; all in :mod:`memlab.protocols`
and re-exported here), and the process-group plumbing of the multi-process ones
(:class:`Ranks`).

An option (``distributed=<name>``) is a registered dataclass with:

- ``processes(device, gpus) -> int``: processes this run needs (1 = this process trains;
  more = ``memlab.distributed.launch`` starts that many workers, one per rank);
- ``validate(ctx) -> list[str]``;
- ``setup(ctx)`` / ``teardown()``: the process group of a worker;
- ``wrap(model, ctx) -> nn.Module``: after PEFT, checkpointing and offload hooks;
- ``sync(model, last) -> context``: gradient synchronisation for one micro-batch (DDP skips it
  on all but the last micro-batch of a step);
- ``all_reduce_sum(values, device) -> list[float]``: sums numbers over the ranks (loss items,
  logged metrics);
- ``generation(model) -> context``: around an online method's ``generate`` (ZeRO-3 / FSDP2
  gather the partitioned weights once);
- ``gathered(param) -> context``: one parameter of the wrapped model, whole, for the block (a
  collective where it is sharded);
- ``memory_roles(model) -> {category: [tensors]}``: the wrapper's own buffers (DeepSpeed's
  partitions, master weights), categorised for the memory tracker;
- ``describe(model) -> dict``: the wrapper's own buffers for the summary (DDP's buckets);
- ``sharding() -> Sharding | None``: what a rank holds, for ``memlab estimate`` (None: one
  plain process);
- ``on_fake_group(ctx) -> context``: entered by ``memlab estimate`` around building and
  stepping a ``wraps_fake_tensors`` wrapper as rank 0 of torch's fake process group; yields
  the assumptions it adds to the estimate's (what it answers without values).

- ``optimizer_tensors(ctx)``: what the optimizer steps: the model's ``parameters``, FSDP2's
  ``dtensors`` (each rank's shard of every parameter) or ZeRO's ``flat_partitions`` (each
  rank's 1-D slice of all the parameters at once); an optimizer option says which it can take
  (:mod:`memlab.optimizer.base`).

Declared capabilities:

- ``reduces_before_grad_hooks`` (a class variable): a parameter's post-accumulate-grad hook sees
  its final gradient, reduced over the ranks (one process; FSDP2, which calls the hooks of the
  sharded parameters after its reduce-scatter), so ``optimizer.in_backward`` can step there
  (DDP averages its buckets after the hooks have run);
- ``wraps_fake_tensors`` (a class variable): its ``wrap`` and steps work on fake weights over a
  fake process group, so ``memlab estimate`` measures a rank (FSDP2, DeepSpeed) instead of
  modelling the sharding (DDP: its C++ reducer reads tensor data, see
  :mod:`memlab.estimate.sharding`);
- ``as_ranks() -> Ranks | None``: a multi-process option (its process group, its rendezvous);
- ``as_step_owner() -> StepOwner | None``: the wrapper owns backward and the optimizer step
  (DeepSpeed's engine): the trainer calls its ``optimizer(model)``, ``backward(model, loss)``
  and ``step(model) -> grad norm`` instead of its own optimizer, ``loss.backward()`` and
  clipping;
- ``as_gathered_states() -> GatheredStates | None`` (FSDP2: checkpoints gathered from the shards
  by parameter name) and ``as_native_states() -> NativeStates | None`` (DeepSpeed: the
  wrapper's own sharded format); neither: one replica's state dicts. See
  :mod:`memlab.trainer.checkpoint`.

Methods call the policy through :mod:`memlab.trainer.routing` (``call_inside``) when they need
only part of it, so the part still runs inside the wrapper's forward.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

import torch

from memlab import registry
from memlab.distributed._replica import Replica
from memlab.protocols import Distributed, GatheredStates, NativeStates, StepOwner
from memlab.protocols import OptimizerTensors as OptimizerTensors
from memlab.protocols import Sharding as Sharding
from memlab.registry import Option, Port, PositiveInt

if TYPE_CHECKING:
    from memlab.protocols import BuildContext


DistributedClass = TypeVar("DistributedClass", bound=Distributed)


def register(name: str) -> Callable[[type[DistributedClass]], type[DistributedClass]]:
    """Register a ``distributed=`` option (mypy checks it against :class:`Distributed`)."""
    return registry.register("distributed", name)


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


class NoCapabilities:
    """None of the optional capabilities (the ``as_<capability>()`` answers): an option mixes
    this in and overrides the ones it has."""

    def as_ranks(self) -> Ranks | None:
        return None

    def as_step_owner(self) -> StepOwner | None:
        return None

    def as_gathered_states(self) -> GatheredStates | None:
        return None

    def as_native_states(self) -> NativeStates | None:
        return None


@dataclass(kw_only=True)
class Ranks(Replica, NoCapabilities, Option):
    """What every multi-process option shares: how many ranks, the process group, sums; and a
    replica's answers (:class:`memlab.distributed._replica.Replica`: ddp's), which the
    sharding options (fsdp2, deepspeed) override."""

    nproc: PositiveInt | None = None
    """Ranks on this machine. None: one per visible GPU on CUDA, 2 on CPU."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on CUDA, gloo on CPU."""
    timeout_s: PositiveInt = 1800
    """How long a rank waits in a collective before the run fails (a dead peer)."""
    master_port: Port = 0
    """Port of the rendezvous store the run's process holds on 127.0.0.1 (the ranks connect
    to it); 0: one the OS gives."""

    wraps_fake_tensors: ClassVar[bool] = False
    reduces_before_grad_hooks: ClassVar[bool] = False

    def processes(self, device: str, gpus: int = 0) -> int:
        """``nproc``, or one rank per visible GPU (``gpus``) on CUDA, 2 on CPU."""
        if self.nproc is not None:
            return self.nproc
        if device.startswith("cuda") and gpus:
            return gpus
        return 2

    def backend_for(self, device: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.startswith("cuda") else "gloo"

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = []
        n = self.processes(ctx.device, ctx.platform.gpus)
        if n < 1:
            errors.append(f"distributed.nproc must be >= 1 (got {n})")
        visible = ctx.platform.gpus
        if ctx.is_cuda and visible and n > visible:  # none visible: checked for another machine
            errors.append(f"distributed.nproc={n} but {visible} CUDA device(s) are visible; "
                          f"set distributed.nproc<={visible} (one rank per GPU)")
        if self.backend_for(ctx.device) == "nccl" and not ctx.is_cuda:
            errors.append("distributed.backend=nccl needs CUDA devices; use "
                          "distributed.backend=gloo (or auto) on CPU")
        if not torch.distributed.is_available():
            errors.append("this torch build has no torch.distributed; use distributed=single")
        extra = ctx.method.as_extra_models()
        if extra is not None and extra.trains_extra_models:
            errors.append(f"distributed={self.name} wraps the policy only, and method="
                          f"{ctx.method.name} also trains another model (PPO's value model); "
                          "use distributed=single")
        return errors

    def setup(self, ctx: BuildContext) -> None:
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

    def as_ranks(self) -> Ranks | None:
        return self
