"""Summed completion log-probs of the sequences of a collated batch (``dpo``, ``kto``).

Not an option of its own. Reads the layouts of :mod:`memlab.method._collate`: padded rows
(one sequence per row) or padding-free rows (``segment_ids`` name each token's sequence).
"""

from __future__ import annotations

import torch
from torch import nn

from memlab.losses import segment_logps, sequence_logps
from memlab.method.base import model_inputs


def completion_logps(model: nn.Module, t: dict[str, torch.Tensor], n: int, prefix: str = ""
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs and scored-token counts of the ``n`` sequences in ``t``
    (padded or padding-free)."""
    logits = model(**model_inputs(t, prefix), use_cache=False).logits
    labels = t[prefix + "labels"]
    if prefix + "segment_ids" in t:
        return segment_logps(logits[0], labels[0], t[prefix + "segment_ids"][0], n)
    return sequence_logps(logits, labels)
