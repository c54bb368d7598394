"""`attention=flash_attention_2`: FlashAttention-2 (CUDA, fp16/bf16, extra `gpu`).

Packed rows go through the varlen kernel: transformers derives cu_seqlens from position_ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.attention.base import Backend, register


@register("flash_attention_2")
@dataclass(kw_only=True)
class FlashAttention2(Backend):
    """No knobs."""

    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")
    package: ClassVar[str | None] = "flash_attn"
