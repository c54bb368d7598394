"""`attention=flex_attention`: torch's flex_attention with a document block mask.

torch 2.13 has no flex_attention backward on CPU, so CPU training runs are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.attention.base import Attention
from memlab.registry import register


@register("attention", "flex_attention")
@dataclass(kw_only=True)
class FlexAttention(Attention):
    """No knobs."""

    trains_on_cpu: ClassVar[bool] = False
