"""The shape of a method and the batch helpers methods share.

A method is a registered dataclass with:

- ``data_kinds``: the row kinds it trains on ('chat', 'text', 'preference'), first = default;
- ``head``: 'causal_lm' or 'seq_cls';
- ``validate(ctx) -> list[str]``;
- ``prepare(ds, tokenizer, ctx) -> (ds, DataStats)``: format -> tokenize -> truncate -> labels
  (packing is applied after this by the pipeline, when the method allows it);
- ``collate(rows, tokenizer, ctx) -> Batch``;
- ``extra_models(policy, ctx, build) -> dict``: other models it needs (e.g. a DPO reference);
- ``before_training(models, ds, ctx) -> ds | None``: optional one-off pass (e.g. cache reference
  log-probs); returns the dataset with the columns it added, or None to keep ``ds``;
- ``loss(models, batch, ctx) -> (loss_sum, metrics)``: the loss *summed* over the batch's
  ``num_items`` (tokens for SFT, pairs for DPO); the trainer divides by the items of the whole
  optimizer step, so gradient accumulation does not change the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

IGNORE = -100


@dataclass
class DataStats:
    """What dataset preparation did to the tokens."""

    examples: int = 0
    rows: int = 0
    tokens_in: int = 0
    tokens_dropped: int = 0
    examples_dropped: int = 0
    fill_ratio: float | None = None
    packing_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


@dataclass
class Batch:
    """Tensors for one micro-batch plus what the trainer needs to normalise and measure."""

    tensors: dict[str, torch.Tensor]
    num_items: int
    """Loss normaliser contributed by this micro-batch (loss tokens, pairs, examples)."""
    real_tokens: int
    """Tokens that are not padding (what tokens/s counts)."""
    total_tokens: int
    """Token slots including padding."""
    size_key: tuple[int, ...] = ()
    """Shape signature; a batch with a larger key may reach a higher memory peak."""
    meta: dict[str, Any] = field(default_factory=dict)

    def to(self, device: str) -> Batch:
        self.tensors = {k: v.to(device, non_blocking=True) for k, v in self.tensors.items()}
        return self


def generates(method) -> bool:
    """Whether ``method`` builds its training batches by sampling in a ``generate`` phase: it
    has a ``rollout`` (online methods), unless its ``generates()`` says not for this config
    (GKD without on-policy or teacher samples)."""
    return callable(getattr(method, "rollout", None)) and \
        getattr(method, "generates", lambda: True)()


def decoder_hidden(model, **inputs: torch.Tensor) -> torch.Tensor:
    """Final hidden states of a causal LM's decoder, no logits (for chunked / fused losses).
    Methods run it through ``memlab.distributed.base.call_inside`` so that it stays inside a
    distributed wrapper's forward."""
    return model.get_decoder()(**inputs, use_cache=False).last_hidden_state


def round_up(n: int, multiple: int | None) -> int:
    if not multiple:
        return n
    return ((n + multiple - 1) // multiple) * multiple


def shifted_labels(input_ids: list[int], loss_mask: list[int]) -> list[int]:
    """labels[t] = input_ids[t+1] where token t+1 counts for the loss; the last token of the
    document predicts nothing. Aligned with input_ids, so documents can be packed safely."""
    n = len(input_ids)
    out = [IGNORE] * n
    for t in range(n - 1):
        if loss_mask[t + 1]:
            out[t] = input_ids[t + 1]
    return out


def pad_batch(
    rows: list[dict[str, list[int]]],
    pad_id: int,
    multiple: int | None,
    columns: dict[str, int],
    with_positions: bool = False,
) -> tuple[dict[str, torch.Tensor], int, int]:
    """Right-pad ``rows`` to the longest row (rounded up to ``multiple``).

    ``columns`` maps per-token column -> pad value. Without ``with_positions`` an
    attention_mask is returned; with it (packed rows), ``position_ids`` restart in the padding
    tail and no attention_mask is given, so transformers isolates each document.
    Returns (tensors, real tokens, total slots).
    """
    lengths = [len(r["input_ids"]) for r in rows]
    width = round_up(max(lengths), multiple)
    out: dict[str, torch.Tensor] = {}
    for col, pad in columns.items():
        t = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : lengths[i]] = torch.tensor(r[col], dtype=torch.long)
        out[col] = t
    if with_positions:
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            pos[i, : lengths[i]] = torch.tensor(r["position_ids"], dtype=torch.long)
            pos[i, lengths[i] :] = torch.arange(width - lengths[i])
        out["position_ids"] = pos
    else:
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        out["attention_mask"] = mask
    return out, sum(lengths), len(rows) * width


def flatten_batch(
    rows: list[dict[str, list[int]]],
    pad_id: int,
    multiple: int | None,
    columns: dict[str, int],
) -> tuple[dict[str, torch.Tensor], int, int]:
    """Padding-free: every row of the batch concatenated into one [1, N] row, position_ids
    restarting at each document (rows' own ``position_ids`` when packed), no attention mask.
    A pad tail (for ``multiple``) gets its own restarting positions and ignored labels."""
    cols: dict[str, list[int]] = {c: [] for c in columns}
    pos: list[int] = []
    for r in rows:
        n = len(r["input_ids"])
        for c in columns:
            cols[c].extend(r[c])
        pos.extend(r["position_ids"] if "position_ids" in r else range(n))
    real = len(pos)
    width = round_up(real, multiple)
    tail = width - real
    for c, pad in columns.items():
        cols[c].extend([pad] * tail)
    pos.extend(range(tail))
    out = {c: torch.tensor([v], dtype=torch.long) for c, v in cols.items()}
    out["position_ids"] = torch.tensor([pos], dtype=torch.long)
    return out, real, width
