"""Liger's fused linear preference losses (``dpo``, ``kto`` with ``use_liger_kernel``): the
checks they share, and the pieces that call them (hidden states without logits, the output
head, the loss value across Liger releases).

Not an option of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlab.method.base import decoder_hidden, model_inputs
from memlab.trainer.routing import call_inside, unwrap

GPU_EXTRA_HINT = "needs a CUDA device and the gpu extra: pip install 'memlab[gpu]'"


def liger_errors(method, ctx, loss_name: str) -> list[str]:
    """Checks shared by ``use_liger_kernel`` on dpo and kto."""
    if not method.use_liger_kernel:
        return []
    what = f"method.use_liger_kernel=true (Liger's fused linear {loss_name} loss)"
    errors = []
    if not ctx.is_cuda:
        errors.append(f"{what} {GPU_EXTRA_HINT}; on CPU set method.use_liger_kernel=false")
    else:
        err = ctx.platform.missing("liger_kernel", what)
        if err:
            errors.append(err)
    if method.padding_free:
        errors.append(f"{what} works on padded [batch, seq] hidden states; set "
                      "method.padding_free=false")
    if method.share_prompt or ctx.packing.packs:
        errors.append(f"{what} works on padded rows of one sequence each; set "
                      "method.share_prompt=false and packing=none")
    if method.reference == "precomputed":
        errors.append(f"{what} computes the reference log-probs itself from the reference's "
                      "hidden states; use method.reference=copy or adapter_disabled")
    targets = getattr(ctx.peft, "target_modules", None)
    if isinstance(targets, list) and "lm_head" in targets:
        errors.append(f"{what} reads the output head's weight directly; drop lm_head from "
                      "peft.target_modules")
    return errors


def liger_module(cls_name: str, **kwargs: Any) -> nn.Module:
    """Instantiate ``liger_kernel.chunked_loss.<cls_name>`` with the keyword arguments its
    installed version accepts (the signature grew over releases)."""
    import inspect

    import liger_kernel.chunked_loss as chunked

    cls = getattr(chunked, cls_name)
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
