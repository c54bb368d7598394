"""Liger's kernels on a loaded model (RMSNorm, RoPE, SwiGLU...: the ``liger_kernels`` a method
selects): CUDA, or Triton's interpreter on CPU for tests (``TRITON_INTERPRET=1`` in the
environment the process started with: Triton reads it when it is imported, and torch imports
it). Imported only when a run asks for Liger; importing this module imports nothing of Liger's.
Applying them is a patch of the model's modules (:func:`memlab.measure.patches.liger_kernels`)."""

from __future__ import annotations

from torch import nn

MODEL_KERNELS = ("rope", "rms_norm", "swiglu", "geglu", "layer_norm")
"""Kernels that replace a model's own modules, named as the keyword arguments of Liger's
``apply_liger_kernel_to_<model type>`` (and the keys of transformers' ``liger_kernel_config``).
A model type that has no such module (``geglu`` on Llama) ignores the name."""


def apply_liger(model: nn.Module, kernels: tuple[str, ...]) -> nn.Module:
    """A loaded transformers model instance with Liger's ``kernels`` (in place); Liger's own
    loss patch stays off: the methods compute their loss themselves."""
    from memlab.measure.patches import liger_kernels

    return liger_kernels(model, {k: k in kernels for k in MODEL_KERNELS})
