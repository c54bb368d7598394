"""`attention=sdpa`: transformers' torch.nn.functional.scaled_dot_product_attention.

Rows holding several documents (packing, padding-free) are isolated through restarting
position_ids. With ``varlen: true`` (default) memlab runs attention per document
(memlab/attention/_varlen.py: cost sum(L_i^2)); with false, transformers' own path builds one
block-diagonal [N, N] mask for the whole row (cost N^2, more than the padding it removes).
"""

from __future__ import annotations

from dataclasses import dataclass

from memlab.attention.base import Attention
from memlab.registry import register


@register("attention", "sdpa")
@dataclass(kw_only=True)
class Sdpa(Attention):
    """Whether multi-document rows run attention per document."""

    varlen: bool = True
    """Per-document attention in packed / padding-free rows (false: one [N, N] block mask)."""

    def implementation(self) -> str:
        if not self.varlen:
            return "sdpa"
        from memlab.attention._varlen import register

        register()
        return "memlab_sdpa_varlen"
