"""Import guards for optional, mostly GPU-only packages. Importing memlab never imports them."""

from __future__ import annotations

import importlib.util

EXTRAS = {
    "flash_attn": "gpu",
    "flash_attn_interface": "gpu (FlashAttention-3 is built from the flash-attention repo's hopper/ dir)",
    "liger_kernel": "gpu",
    "bitsandbytes": "gpu",
    "kernels": "gpu",
    "deepspeed": "deepspeed",
    "vllm": "vllm",
    "wandb": "wandb",
    "matplotlib": "report",
}


def has(module: str) -> bool:
    """True when ``module`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(module: str, what: str) -> str | None:
    """None if ``module`` is installed, else an error naming the extra that provides it."""
    if has(module):
        return None
    extra = EXTRAS.get(module, module)
    return (
        f"{what} needs the '{module}' package, which is not installed; "
        f"install the extra: pip install 'memlab[{extra.split()[0]}]'"
        + (f" ({extra})" if " " in extra else "")
    )


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
