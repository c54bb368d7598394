"""`attention=eager`: transformers' plain PyTorch (matmul + softmax) attention.

Rows holding several documents (packing, padding-free) are isolated through restarting
position_ids. With ``varlen: true`` (default) memlab runs attention per document
(memlab/attention/_varlen.py: cost sum(L_i^2)); with false, transformers' own path builds one
block-diagonal [N, N] mask for the whole row (cost N^2, more than the padding it removes).
"""

from __future__ import annotations

from dataclasses import dataclass

from memlab.attention.base import VarlenBackend, register


@register("eager")
@dataclass(kw_only=True)
class Eager(VarlenBackend):
    """Knob: ``varlen`` (see VarlenBackend)."""
