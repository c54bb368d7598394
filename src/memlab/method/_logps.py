"""Summed completion log-probs of the sequences of a collated batch (``dpo``, ``kto``).

Not an option of its own. Reads the layouts of :mod:`memlab.method._collate` (padded rows, one
sequence per row; padding-free rows, ``segment_ids`` naming each token's sequence) and of
:mod:`memlab.method._layout` (packed / shared-prompt rows: ``segment_ids`` over every row, plus
the fork labels of shared prompts: the prompt's last token scored once more for each further
completion).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlab.losses import forked_token_logps, segment_logps, sequence_logps, token_logps
from memlab.method.base import LOSS_INDEX, LOSS_LABELS, LOSS_SEQS, head_logits, model_inputs


def document_inputs(t: dict[str, Any], prefix: str = "", attention: Any = None
                    ) -> dict[str, Any]:
    """The model's keyword arguments for batch ``t``, with the attention mask the run's
    ``attention`` option needs to see the rows' documents as their segments describe (a
    flex_attention block mask for shared prompts; None for backends that read the segments or
    the position ids themselves)."""
    inputs = model_inputs(t, prefix)
    segments = t.get(prefix + "segments")
    if attention is not None and segments is not None:
        mask = attention.document_mask(segments, t[prefix + "input_ids"].shape[1],
                                       t[prefix + "input_ids"].device)
        if mask is not None:
            inputs["attention_mask"] = mask
    return inputs


def completion_logps(model: nn.Module, t: dict[str, torch.Tensor], n: int, prefix: str = "",
                     attention: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs and scored-token counts of the ``n`` sequences in ``t``
    (padded, padding-free, or packed / shared-prompt rows). A batch that lists its scored
    tokens (``head_on=labelled``: :data:`memlab.method.base.LOSS_INDEX` with their labels and
    sequences) runs the output head at those positions only."""
    inputs = document_inputs(t, prefix, attention)
    if prefix + LOSS_INDEX in t:
        logits = head_logits(model, inputs, t[prefix + LOSS_INDEX], labelled=True)
        per_token = token_logps(logits, t[prefix + LOSS_LABELS])
        seqs = t[prefix + LOSS_SEQS]
        sums = per_token.new_zeros(n).index_add(0, seqs, per_token)
        counts = torch.zeros(n, dtype=torch.long, device=seqs.device).index_add_(
            0, seqs, torch.ones_like(seqs))
        return sums, counts
    logits = model(**inputs, use_cache=False).logits
    labels = t[prefix + "labels"]
    if prefix + "fork_index" in t:
        return layout_logps(logits, t, n, prefix)
    if prefix + "segment_ids" in t:
        return segment_logps(logits[0], labels[0], t[prefix + "segment_ids"][0], n)
    return sequence_logps(logits, labels)


def layout_logps(logits: torch.Tensor, t: dict[str, torch.Tensor], n: int, prefix: str = ""
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums over rows of documents (:mod:`memlab.method._layout`): every scored
    token by its ``segment_ids``, then each fork label (a shared prompt's last token predicting
    the first token of a further completion) added to its sequence."""
    labels, index = t[prefix + "labels"], t[prefix + "fork_index"]
    per_token, fork = forked_token_logps(logits, labels, index, t[prefix + "fork_labels"])
    sums, counts = segment_logps(per_token, labels, t[prefix + "segment_ids"], n)
    if index.numel():
        seg = t[prefix + "fork_segments"]
        sums = sums.index_add(0, seg, fork.to(sums.dtype))
        counts = counts.index_add(0, seg, torch.ones_like(seg))
    return sums, counts
