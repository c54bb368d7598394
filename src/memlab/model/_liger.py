"""Liger kernels (fused RMSNorm, RoPE, SwiGLU, fused linear cross-entropy): CUDA + the `gpu`
extra. Imported only when a run asks for them."""

from __future__ import annotations

from torch import nn


def liger_errors(ctx, what: str) -> list[str]:
    """Validation shared by every method's ``use_liger_kernel``."""
    if not ctx.is_cuda:
        return [f"{what}.use_liger_kernel=true needs a CUDA device (Liger's kernels are Triton "
                "GPU kernels) and the gpu extra: pip install 'memlab[gpu]'; on CPU set "
                f"{what}.use_liger_kernel=false (method.loss_impl=chunked gives the fused-loss "
                "memory saving on any device)"]
    err = ctx.platform.missing("liger_kernel", f"{what}.use_liger_kernel=true")
    return [err] if err else []


def apply_liger(model: nn.Module) -> nn.Module:
    """Patch a loaded transformers model instance with Liger's kernels (in place)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    return model
