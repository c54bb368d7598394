"""Liger-Kernel in the methods that have it (``sft``, ``dpo``, ``kto``; their
``as_liger()``: :class:`memlab.protocols.LigerUser`): the knobs they share (:class:`LigerKnobs`),
the rules those knobs follow, and the pieces that call Liger (hidden states without logits, the
output head, the loss value across Liger releases). The other methods answer ``as_liger()``
with None (:class:`memlab.method.base.NoCapabilities`).

Not an option of its own.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

from memlab.method.base import decoder_hidden, model_inputs
from memlab.model._liger import MODEL_KERNELS
from memlab.trainer.routing import call_inside, unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext

LigerKernel = Literal["rope", "rms_norm", "swiglu", "geglu", "layer_norm",
                      "fused_linear_cross_entropy"]
LOSS_KERNEL: LigerKernel = "fused_linear_cross_entropy"
LIGER_LOSS = "method.liger_kernels=[..., fused_linear_cross_entropy]"
"""The setting of a method whose loss is Liger's fused linear one (it reads the output head's
weight directly: ``LigerUser.reads_head_weight``)."""
INTERPRETED = ("rope", LOSS_KERNEL)
"""The kernels that run in Triton's interpreter (measured with triton 3.9.0, liger-kernel 0.8.5:
the same loss and gradients as without Liger); RMSNorm, SwiGLU (and the layer norm / GeGLU of
the same family) fail inside it (``InterpreterError: AttributeError("'float' object has no
attribute 'to'")``)."""


@dataclass(kw_only=True)
class LigerKnobs:
    """Liger's knobs, shared by the methods that have a Liger path (mixed into their configs)."""

    use_liger_kernel: bool = False
    """Liger-Kernel's Triton kernels (TRL's ``use_liger_kernel``): the model's modules named in
    ``liger_kernels`` and, with ``fused_linear_cross_entropy``, the method's loss fused with the
    output head (never materialises the [tokens, vocab] logits). CUDA and the gpu extra; on CPU
    only through ``triton_interpret``."""
    liger_kernels: list[LigerKernel] = field(default_factory=lambda: [
        "rope", "rms_norm", "swiglu", LOSS_KERNEL])
    """Which of Liger's kernels, by the names of Liger's ``apply_liger_kernel_to_<model>``
    arguments (transformers' ``liger_kernel_config`` keys): rope, rms_norm, swiglu, geglu,
    layer_norm replace the model's modules (a name the model type has no module for is
    ignored); fused_linear_cross_entropy is the loss: SFT's cross-entropy, DPO's / KTO's fused
    linear preference loss (Liger's chunked losses)."""
    triton_interpret: bool = False
    """Allow Liger on a CPU run: its Triton kernels run in Triton's interpreter, which the
    process must have been started with (``TRITON_INTERPRET=1 memlab ...``: Triton reads it when
    torch imports it). Exact, and orders of magnitude slower: a test vehicle, never a speed
    path. Only rope and fused_linear_cross_entropy work there."""

    def uses_liger(self) -> bool:
        return self.use_liger_kernel

    def liger_model_kernels(self) -> tuple[str, ...]:
        if not self.use_liger_kernel:
            return ()
        return tuple(k for k in self.liger_kernels if k in MODEL_KERNELS)

    def liger_loss(self) -> bool:
        """Whether the loss is Liger's fused linear one."""
        return self.use_liger_kernel and LOSS_KERNEL in self.liger_kernels

    def liger_errors(self, ctx: BuildContext) -> list[str]:
        """Where Liger can run, and the kernels it can run there (a LoRA adapter on the head
        its fused loss reads is ``peft=lora``'s rule: ``LigerUser.reads_head_weight``)."""
        if not self.use_liger_kernel:
            return []
        if not self.liger_kernels:
            return ["method.liger_kernels is empty: name Liger's kernels to apply (e.g. "
                    "[rope,fused_linear_cross_entropy]) or set method.use_liger_kernel=false"]
        errors = []
        if ctx.is_cuda:
            if self.triton_interpret:
                errors.append("method.triton_interpret=true runs Liger's kernels in Triton's "
                              "interpreter, a CPU test vehicle; on a CUDA run set "
                              "method.triton_interpret=false")
        elif not self.triton_interpret:
            errors.append("method.use_liger_kernel=true needs a CUDA device and the gpu extra: "
                          "pip install 'memlab[gpu]' (Liger's kernels are Triton GPU kernels); "
                          "on CPU set method.use_liger_kernel=false (method.loss_impl=chunked "
                          "gives the fused loss's memory saving on any device), or opt in to "
                          "Triton's interpreter (exact, very slow: a test vehicle) with "
                          "method.triton_interpret=true")
        else:
            errors += self._interpreter_errors(ctx)
        err = ctx.platform.missing("liger_kernel", "method.use_liger_kernel=true")
        if err:
            errors.append(err)
        return errors

    def _interpreter_errors(self, ctx: BuildContext) -> list[str]:
        errors = []
        failing = [k for k in self.liger_kernels if k not in INTERPRETED]
        if failing:
            keep = ",".join(k for k in self.liger_kernels if k in INTERPRETED) or "rope"
            errors.append(f"method.liger_kernels: {', '.join(failing)} fail inside Triton's "
                          "interpreter (only rope and fused_linear_cross_entropy run there); "
                          f"set method.liger_kernels=[{keep}] or run on a CUDA device")
        if not ctx.platform.triton_interpret:
            errors.append("method.triton_interpret=true needs the process started with "
                          "TRITON_INTERPRET=1 in its environment (Triton reads it when torch "
                          "imports it): TRITON_INTERPRET=1 memlab ...")
        return errors


class LigerPairs(Protocol):
    """The knobs of a preference method that Liger's fused preference losses constrain."""

    def liger_loss(self) -> bool: ...
    @property
    def padding_free(self) -> bool: ...
    @property
    def share_prompt(self) -> bool: ...
    @property
    def reference(self) -> str: ...


def preference_errors(method: LigerPairs, ctx: BuildContext, loss_name: str) -> list[str]:
    """Checks of Liger's fused linear preference losses (dpo, kto)."""
    if not method.liger_loss():
        return []
    what = f"Liger's fused linear {loss_name} loss (method.use_liger_kernel=true)"
    errors = []
    if method.padding_free:
        errors.append(f"{what} works on padded [batch, seq] hidden states; set "
                      "method.padding_free=false")
    if method.share_prompt or ctx.packing.packs:
        errors.append(f"{what} works on padded rows of one sequence each; set "
                      "method.share_prompt=false and packing=none")
    if method.reference == "precomputed":
        errors.append(f"{what} computes the reference log-probs itself from the reference's "
                      "hidden states; use method.reference=copy or adapter_disabled")
    return errors


def liger_module(method: LigerKnobs, cls_name: str, **kwargs: Any) -> nn.Module:
    """Instantiate ``liger_kernel.chunked_loss.<cls_name>`` with the keyword arguments its
    installed version accepts (the signature grew over releases). Its ``compiled`` chunk
    function (torch.compile) stays off in Triton's interpreter: there it would compile for the
    CPU what the test compares."""
    import liger_kernel.chunked_loss as chunked

    cls = getattr(chunked, cls_name)
    if method.triton_interpret:
        kwargs = {**kwargs, "compiled": False}
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in accepted})


def liger_loss_value(out: Any) -> torch.Tensor:
    """Liger losses return the loss or ``(loss, aux...)`` depending on the release."""
    return out[0] if isinstance(out, (tuple, list)) else out


def hidden_and_head(model: nn.Module, t: dict[str, torch.Tensor], prefix: str = ""
                    ) -> tuple[torch.Tensor, nn.Module]:
    """Final hidden states ``[S, T, H]`` (no logits) and the output head of a causal LM."""
    hidden = call_inside(model, decoder_hidden, **model_inputs(t, prefix))
    return hidden, unwrap(model).get_output_embeddings()
