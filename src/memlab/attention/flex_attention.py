"""`attention=flex_attention`: torch's flex_attention with a document block mask.

torch 2.13 has no flex_attention backward on CPU, so CPU training runs are rejected.

Packed rows of plain documents get transformers' own block mask (documents from the restarting
position ids). Rows where a document also sees a shared prefix (a preference pair's prompt
stored once) get memlab's block mask built from the rows' segments
(:func:`memlab.attention._varlen.block_mask`), passed as the model's ``attention_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from memlab.attention.base import Backend, register


@register("flex_attention")
@dataclass(kw_only=True)
class FlexAttention(Backend):
    """No knobs."""

    trains_on_cpu: ClassVar[bool] = False

    def shares_prefix(self) -> bool:
        return True

    def document_mask(self, segments, width: int, device) -> Any:
        if not segments.shares_prefixes():
            return None
        from memlab.attention._varlen import block_mask

        return block_mask(segments, width, device)
