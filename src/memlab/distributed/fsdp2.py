"""`distributed=fsdp2`: fully sharded data parallel (torch's ``fully_shard``, FSDP2) over N
processes on this machine, started like ``ddp`` (``memlab.distributed.launch``).

Each decoder layer is one FSDP unit, and the rest of the model (embeddings, final norm, output
head) is the root unit. Parameters, gradients and optimizer state are sharded over the ranks
(each rank holds 1/N of every parameter as a DTensor shard); a unit's full parameters exist only
while it runs (all-gathered before its forward and again before its backward), and its gradients
are reduce-scattered right after its backward. With ``reshard_after_forward: false`` a unit keeps
its gathered parameters from forward to backward (ZeRO-2-like: more memory, one all-gather less).

Per-rank memory therefore is: 1/N of parameters + gradients + optimizer state, plus the gathered
units in flight, plus the rank's own activations - what ``memlab estimate --zero-stage 3``
models, and what each rank's tracker measures here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from memlab.distributed.base import GatheredStates, OptimizerTensors, Ranks, Sharding, register
from memlab.trainer.routing import Routed, base_model, unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext

_ROOT = "module."  # the Routed root's prefix in state-dict names


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules whose class the model lists in ``_no_split_modules``
    (transformers' own marker for "keep this block on one device")."""
    base = base_model(unwrap(model))
    names = set(getattr(base, "_no_split_modules", None) or ())
    # by class name through the MRO: fully_shard turns a LlamaDecoderLayer into a subclass
    return [m for m in base.modules() if any(c.__name__ in names for c in type(m).__mro__)]


@register("fsdp2")
@dataclass(kw_only=True)
class FSDP2(Ranks):
    """Fully sharded data parallel: parameters, gradients and optimizer state split over ranks."""

    wraps_fake_tensors: ClassVar[bool] = True
    reduces_before_grad_hooks: ClassVar[bool] = True
    """FSDP2 calls a sharded parameter's post-accumulate-grad hooks right after its
    reduce-scatter (``foreach_reduce``): ``optimizer.in_backward`` steps the reduced shard."""

    reshard_after_forward: bool = True
    """true: free a layer's gathered parameters after its forward (ZeRO-3); false: keep them
    until its backward (ZeRO-2-like)."""
    gather_for_generation: bool = True
    """Online methods: all-gather every unit once for a whole ``generate`` call (fast; every
    rank briefly holds the whole weights) instead of once per unit per decoding step."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        liger = ctx.method.as_liger()
        if liger is not None and liger.uses_liger():
            errors.append("distributed=fsdp2 with method.use_liger_kernel=true is not supported "
                          "yet (Liger reads the sharded output head outside the forward); use "
                          "method.loss_impl=chunked or distributed=ddp")
        return errors

    def wrap(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda" if ctx.is_cuda else "cpu", (ctx.world_size,))
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"distributed=fsdp2 found no decoder layers in "
                             f"{type(unwrap(model)).__name__} (no _no_split_modules)")
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        # the root: embeddings, norm, head; ``Routed`` lets methods run a part of the model
        # inside the root's forward (call_inside), where every unit's hooks fire as usual
        root = fully_shard(Routed(model), mesh=mesh,
                           reshard_after_forward=self.reshard_after_forward)
        return cast(nn.Module, root)  # the Routed module itself, now also an FSDPModule

    @contextlib.contextmanager
    def sync(self, model: nn.Module, last: bool) -> Iterator[None]:
        """Reduce-scatter gradients only in the step's last micro-batch (earlier ones
        accumulate unsharded gradients locally)."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(last)
        yield

    @contextlib.contextmanager
    def generation(self, model: nn.Module) -> Iterator[None]:
        """Around an online method's ``generate``: with ``gather_for_generation`` every unit is
        gathered once and kept gathered until the call ends, then resharded."""
        if not self.gather_for_generation:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        layers = [m for m in units if m is not model]  # the root never reshards after forward
        for m in layers:
            m.set_reshard_after_forward(False, recurse=False)
        for m in units:
            m.unshard()
        try:
            yield
        finally:
            for m in units:
                m.reshard()
            for m in layers:
                m.set_reshard_after_forward(self.reshard_after_forward, recurse=False)

    @contextlib.contextmanager
    def gathered(self, param: torch.Tensor) -> Iterator[torch.Tensor]:
        """A sharded parameter (a DTensor) all-gathered: every rank calls it."""
        from torch.distributed.tensor import DTensor

        local = param.detach()
        yield local.full_tensor() if isinstance(local, DTensor) else param

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The gathered (unsharded) trainable weights, named as in the unwrapped model, and the
        optimizer state keyed by parameter name, on CPU. A collective: every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                ignore_frozen_params=True)
        weights, optim = get_state_dict(model, optimizer, options=opts)
        return {k.removeprefix(_ROOT): v for k, v in weights.items()}, optim

    def load_full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        weights: dict[str, Any], optim: dict[str, Any]) -> None:
        """Shard a :meth:`full_state` back onto this rank's model and optimizer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_state_dict(model, optimizer, model_state_dict={_ROOT + k: v for k, v in
                                                           weights.items()},
                       optim_state_dict=optim, options=opts)

    def describe(self, model: nn.Module) -> dict[str, Any]:
        return {"units": len(decoder_layers(model)) + 1,
                "reshard_after_forward": self.reshard_after_forward}

    def optimizer_tensors(self, ctx: BuildContext) -> OptimizerTensors:
        """Each parameter is a DTensor, this rank's shard of it."""
        return "dtensors"

    def sharding(self) -> Sharding | None:
        """Parameters, gradients and optimizer state split over the ranks (ZeRO-3)."""
        return Sharding(zero_stage=3)

    def as_gathered_states(self) -> GatheredStates | None:
        return self
