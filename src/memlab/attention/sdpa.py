"""`attention=sdpa`: transformers' torch.nn.functional.scaled_dot_product_attention.

Packed / padding-free rows are isolated through restarting position_ids: with no
attention_mask and use_cache=False, transformers builds a block-diagonal causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

from memlab.attention.base import Attention
from memlab.registry import register


@register("attention", "sdpa")
@dataclass(kw_only=True)
class Sdpa(Attention):
    """No knobs."""
