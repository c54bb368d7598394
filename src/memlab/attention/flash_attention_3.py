"""`attention=flash_attention_3`: FlashAttention-3 (Hopper GPUs, fp16/bf16, varlen packing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.attention.base import Backend, register


@register("flash_attention_3")
@dataclass(kw_only=True)
class FlashAttention3(Backend):
    """No knobs."""

    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    dtypes: ClassVar[tuple[str, ...]] = ("bfloat16", "float16")
    package: ClassVar[str | None] = "flash_attn_interface"
