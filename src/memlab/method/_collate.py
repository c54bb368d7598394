"""Sequences -> one batch, for the methods that score whole sequences (``dpo``, ``kto``,
``reward``).

Not an option of its own. A method turns its rows into a list of sequences (``prompt +
completion`` with labels on the completion only, shifted per sequence, :func:`sequence`) and
collates them either padded ``[S, T]`` with an attention mask, or padding-free: one ``[1, N]``
row, position_ids restarting at every sequence, no attention mask, the row's document
``segments``, and ``segment_ids`` naming each token's sequence.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from memlab.method.base import (
    IGNORE,
    flatten_batch,
    pad_batch,
    scored_tensors,
    sequence_scored,
    shifted_labels,
)
from memlab.trainer.routing import unwrap


def sequence(prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
    """``prompt + completion`` and its labels: shifted, on the completion tokens only."""
    ids = list(prompt) + list(completion)
    return ids, shifted_labels(ids, [0] * len(prompt) + [1] * len(completion))


def collate_sequences(seqs: list[tuple[list[int], list[int]]], pad_id: int,
                      multiple: int | None, flat: bool, scored: bool = False,
                      seq_ids: list[int] | None = None
                      ) -> tuple[dict[str, torch.Tensor], int, int]:
    """Padded ``[S, T]`` (attention_mask) or padding-free ``[1, N]`` (position_ids restarting per
    sequence, ``segment_ids`` = sequence index, -1 on the pad tail). Also returns
    ``last_index``: the position of each sequence's last token (reward pooling), and with
    ``scored`` the labelled positions (:func:`memlab.method.base.scored_tensors`; ``seq_ids``
    names the sequences there, default their index).
    Returns (tensors, real tokens, total slots)."""
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in seqs]
    lengths = [len(r["input_ids"]) for r in rows]
    if flat:
        for i, r in enumerate(rows):
            r["segment_ids"] = [i] * len(r["input_ids"])
        t, real, total = flatten_batch(rows, pad_id, multiple,
                                       {"input_ids": pad_id, "labels": IGNORE, "segment_ids": -1})
        starts = [0, *itertools.accumulate(lengths)][:-1]
        ends = [s + n - 1 for s, n in zip(starts, lengths, strict=True)]
    else:
        t, real, total = pad_batch(rows, pad_id, multiple,
                                   {"input_ids": pad_id, "labels": IGNORE})
        width = t["input_ids"].shape[1]
        starts = [i * width for i in range(len(rows))]
        ends = [n - 1 for n in lengths]
    t["last_index"] = torch.tensor(ends, dtype=torch.long)
    if scored:
        t.update(scored_tensors(sequence_scored([r["labels"] for r in rows], starts, seq_ids)))
    return t, real, total


def pad_id_of(models: dict[str, nn.Module]) -> int:
    """The pad id the loader wrote into the model config (any value works under a mask)."""
    cfg = getattr(unwrap(models["policy"]), "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    return int(pad) if pad is not None else 0
