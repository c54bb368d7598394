"""What an optimizer option provides (:class:`Optimizer`, in :mod:`memlab.protocols` and
re-exported here), the knobs every option shares
(:class:`OptimizerKnobs`: ``in_backward``), and the rules of stepping inside backward.

An option (``optimizer=<name>``) is a registered dataclass of its hyperparameters (the learning
rate, its schedule and the weight decay stay in ``train:``, as TRL's ``learning_rate`` /
``weight_decay`` do for every ``optim``) with:

- ``build(params, ctx, model, foreach) -> torch.optim.Optimizer``: the optimizer over the
  trainable ``params`` (``model``: the policy, for options that treat some modules apart, e.g.
  8-bit AdamW's 32-bit embedding states; None where the optimizer gets flat partitions);
- ``group_settings() -> dict``: the param-group values this configuration sets (``betas``,
  ``eps``, ``momentum``...), which a resumed run applies over the checkpoint's;
- ``validate(ctx)``: its own problems and the in-backward rules (below);
- declared: ``takes_dtensors`` (it can step FSDP2's DTensor shards) and
  ``takes_flat_partitions`` (it can step ZeRO's flat 1-D partitions, which mix parameters).

``in_backward: true`` (torchtune's ``optimizer_in_bwd``, the LOMO idea): each parameter is
stepped, and its gradient freed, in its post-accumulate-grad hook, as soon as backward has
produced it; at the peak only the gradients of the parameters backward is still working on
exist (:func:`memlab.trainer.optim.step_in_backward`). It gives the same parameters as the
standard step exactly when a step is one backward whose gradients are final when each hook
runs: one micro-batch per step (``train.grad_accum=1``), no gradient clipping (it needs every
gradient's norm before any step), no fp16 loss scaling (the scaler unscales and skips steps on
every gradient at once), and a distributed option whose hooks see reduced gradients (FSDP2
yes; DDP reduces its buckets after the hooks run; DeepSpeed owns the step). Every other
combination is refused before any model loads, with the setting to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

from memlab import registry
from memlab.protocols import Optimizer
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.protocols import BuildContext


OptimizerClass = TypeVar("OptimizerClass", bound=Optimizer)


def register(name: str) -> Callable[[type[OptimizerClass]], type[OptimizerClass]]:
    """Register an ``optimizer=`` option (mypy checks it against :class:`Optimizer`)."""
    return registry.register("optimizer", name)


@dataclass(kw_only=True)
class OptimizerKnobs(Option):
    """What every option shares: ``in_backward`` and its rules, and the distributed checks of
    its declared capabilities."""

    in_backward: bool = False
    """Step each parameter inside backward as soon as its gradient is ready, then free the
    gradient (torchtune's ``optimizer_in_bwd``): the ``gradients`` category at the peak drops
    from every gradient to those backward is still producing. Exact (the same parameters as the
    standard step) with one micro-batch per step and no clipping: set ``train.grad_accum=1``
    and ``train.max_grad_norm=null``; refused otherwise."""

    takes_dtensors: ClassVar[bool] = True
    takes_flat_partitions: ClassVar[bool] = True

    def validate(self, ctx: BuildContext) -> list[str]:
        return self.in_backward_errors(ctx) + self.layout_errors(ctx)

    def in_backward_errors(self, ctx: BuildContext) -> list[str]:
        """Why ``in_backward`` cannot be exact in this run (each with its fix)."""
        if not self.in_backward:
            return []
        errors = []
        head = "optimizer.in_backward=true steps each parameter as soon as backward produced " \
               "its gradient"
        if ctx.train.grad_accum > 1:
            errors.append(f"{head}, but train.grad_accum={ctx.train.grad_accum} sums the "
                          "gradients of several micro-batches before a step; set "
                          "train.grad_accum=1 (raise train.batch_size for the same batch) or "
                          "optimizer.in_backward=false")
        if ctx.train.max_grad_norm is not None:
            errors.append(f"{head}, but train.max_grad_norm={ctx.train.max_grad_norm} clips by "
                          "the norm of every gradient, known only after backward; set "
                          "train.max_grad_norm=null or optimizer.in_backward=false")
        if ctx.precision.needs_scaler:
            errors.append(f"{head}, but precision={ctx.precision.name} scales the loss and "
                          "unscales (or skips) the step over every gradient at once; use "
                          "precision=bf16_mixed or optimizer.in_backward=false")
        dist = ctx.distributed
        if dist.as_step_owner() is not None:
            errors.append(f"{head}, but distributed={dist.name} owns the optimizer step (it "
                          "steps its own partitions after backward); use distributed=fsdp2 or "
                          "optimizer.in_backward=false")
        elif not dist.reduces_before_grad_hooks:
            errors.append(f"{head}, but under distributed={dist.name} a parameter's hook sees "
                          "this rank's gradient before the ranks' gradients are averaged; use "
                          "distributed=fsdp2 (its hooks see the reduced shard) or "
                          "optimizer.in_backward=false")
        return errors

    def layout_errors(self, ctx: BuildContext) -> list[str]:
        """The tensors the distributed option hands the optimizer, against what it can step."""
        layout = ctx.distributed.optimizer_tensors(ctx)
        name = f"optimizer={self.name}"
        if layout == "dtensors" and not self.takes_dtensors:
            return [f"{name} cannot step distributed={ctx.distributed.name}'s parameters: they "
                    f"are DTensor shards, {self.dtensor_reason()}; use optimizer=adamw (or "
                    "adafactor), or distributed=ddp / deepspeed"]
        if layout == "flat_partitions" and not self.takes_flat_partitions:
            return [f"{name} cannot step distributed={ctx.distributed.name}'s flat partitions "
                    f"(ZeRO hands the optimizer 1-D slices of all the parameters at once): "
                    f"{self.flat_reason()}; use optimizer=adamw or adamw_8bit, or a layout "
                    "with whole parameters (distributed.zero_stage=0 with fp32 weights, "
                    "distributed=ddp)"]
        return []

    def dtensor_reason(self) -> str:
        """Why this option cannot step DTensors (for the error; only when it cannot)."""
        return ""

    def flat_reason(self) -> str:
        """Why this option cannot step flat partitions (for the error; only when it cannot)."""
        return ""
