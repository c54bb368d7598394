"""bitsandbytes' AdamW with 8-bit states, shared by ``adamw_8bit`` and ``paged_adamw_8bit``.

The states of a parameter with at least ``min_8bit_size`` elements are two ``uint8`` tensors of
its shape (the first moment signed, the second unsigned, each quantized blockwise: blocks of
256 values with one fp32 absmax each) and two 256-entry fp32 code books (``qmap1``, ``qmap2``,
shared by every parameter); a smaller one keeps two fp32 states. That is ~2.03 bytes a
parameter instead of AdamW's 8. The tracker books all of it as ``optimizer``.

memlab's subclass changes no update; it differs from ``bnb.optim.AdamW(optim_bits=8)`` in two
places. The parameters kept at 32-bit states (``embedding_states_32bit``) are a param group with
``optim_bits: 32``, read per optimizer, where bitsandbytes (and transformers' Trainer) register
them in a process-wide manager keyed by ``id(param)``, which outlives the run. And the code
books are made outside any fake-tensor mode and follow the parameters' kind when the first state
is made, so that ``memlab estimate`` steps it on fake tensors like any torch optimizer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from memlab.optimizer.adamw import Beta, beta_errors
from memlab.optimizer.base import OptimizerKnobs
from memlab.registry import PositiveFloat, PositiveInt

if TYPE_CHECKING:
    from memlab.context import BuildContext

INSTALL = ("bash scripts/setup_cpu_kernels.sh in a checkout, then PYTHONPATH=.cpu-kernels; or "
           "pip install bitsandbytes (its 8-bit optimizers run on CPU tensors too; on a CUDA "
           "machine: pip install 'memlab[gpu]')")
"""How to install bitsandbytes, for the errors."""


@functools.cache
def adamw_class() -> Callable[..., torch.optim.Optimizer]:
    """memlab's subclass of ``bitsandbytes.optim.AdamW`` (module docstring); imports
    bitsandbytes."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import maybe_get_fake_mode, unset_fake_temporarily

    class AdamW8bit(bnb.optim.AdamW):
        """bitsandbytes' AdamW, 8-bit states (module docstring)."""

        def fill_qmap(self) -> None:
            with unset_fake_temporarily():  # the code books are values, never fake
                super().fill_qmap()

        def get_config(self, gindex, pindex, group):
            config = super().get_config(gindex, pindex, group)
            if group.get("optim_bits") is not None:  # this group's own state width
                config["optim_bits"] = group["optim_bits"]
            return config

        def init_state(self, group, p, gindex, pindex):
            mode = maybe_get_fake_mode(p)
            if mode is not None:  # the code books as the parameter's kind of tensor
                for k, v in list(self.name2qmap.items()):
                    if maybe_get_fake_mode(v) is None:
                        self.name2qmap[k] = mode.from_tensor(v)
            super().init_state(group, p, gindex, pindex)

    return AdamW8bit


def embedding_weights(model: nn.Module | None, params: list[nn.Parameter]
                      ) -> set[int]:
    """``id`` of the trained ``params`` that are an embedding's weight (``nn.Embedding``; a
    tied output head shares the input embedding's)."""
    if model is None:
        return set()
    ids = {id(p) for p in params}
    return {id(m.weight) for m in model.modules()
            if isinstance(m, nn.Embedding) and id(m.weight) in ids}


@dataclass(kw_only=True)
class AdamW8bitKnobs(OptimizerKnobs):
    """bitsandbytes' 8-bit AdamW knobs (named as its ``AdamW``'s arguments)."""

    betas: list[Beta] = field(default_factory=lambda: [0.9, 0.999])
    """(beta1, beta2), as ``optimizer=adamw``'s."""
    eps: PositiveFloat = 1e-8
    """Added to the second moment's square root (TRL's ``adam_epsilon``)."""
    min_8bit_size: PositiveInt = 4096
    """Parameters with fewer elements keep fp32 states (norms, biases)."""
    embedding_states_32bit: bool = False
    """Keep the embeddings' states in fp32 (bitsandbytes' advice for stable training; what
    transformers' Trainer, so TRL's ``optim="adamw_bnb_8bit"``, does). A tied output head
    shares the input embedding's weight, so its states are fp32 too: at a real vocabulary
    that is a large share of the model (Qwen2.5-0.5B: 136M of 494M parameters)."""

    paged: ClassVar[bool] = False
    takes_dtensors: ClassVar[bool] = False

    def dtensor_reason(self) -> str:
        return ("and bitsandbytes' 8-bit update is a custom operator without a DTensor sharding "
                "rule")

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = beta_errors(self.betas) + super().validate(ctx)
        if not ctx.platform.has("bitsandbytes"):
            errors.append(f"optimizer={self.name} keeps its states in 8 bits with the "
                          f"'bitsandbytes' package, which is not installed: {INSTALL}; or use "
                          "optimizer=adamw")
        if self.embedding_states_32bit and \
                ctx.distributed.optimizer_tensors(ctx) == "flat_partitions":
            errors.append(f"optimizer.embedding_states_32bit=true: distributed="
                          f"{ctx.distributed.name} hands the optimizer flat partitions of all "
                          "the parameters, with no embedding apart; set "
                          "optimizer.embedding_states_32bit=false")
        return errors

    def build(self, params: list[nn.Parameter], ctx: BuildContext,
              model: nn.Module | None = None, foreach: bool | None = None
              ) -> torch.optim.Optimizer:
        wide = embedding_weights(model, params) if self.embedding_states_32bit else set()
        groups: list[dict[str, Any]] = [{"params": [p for p in params if id(p) not in wide]}]
        if wide:
            groups.append({"params": [p for p in params if id(p) in wide], "optim_bits": 32})
        return adamw_class()(groups, lr=ctx.train.lr, betas=(self.betas[0], self.betas[1]),
                             eps=self.eps, weight_decay=ctx.train.weight_decay, optim_bits=8,
                             min_8bit_size=self.min_8bit_size, is_paged=self.paged)

    def group_settings(self) -> dict[str, Any]:
        return {"betas": tuple(self.betas), "eps": self.eps}
