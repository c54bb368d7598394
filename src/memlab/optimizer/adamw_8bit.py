"""`optimizer=adamw_8bit`: bitsandbytes' AdamW with 8-bit blockwise-quantized states (TRL's
``optim="adamw_bnb_8bit"``): ~2 bytes of state a parameter instead of AdamW's 8
(:mod:`memlab.optimizer._bnb`). Runs on CPU tensors too (bitsandbytes >= 0.45)."""

from __future__ import annotations

from dataclasses import dataclass

from memlab.optimizer._bnb import AdamW8bitKnobs
from memlab.optimizer.base import register


@register("adamw_8bit")
@dataclass(kw_only=True)
class AdamW8bit(AdamW8bitKnobs):
    """bitsandbytes' ``AdamW(optim_bits=8)``."""
