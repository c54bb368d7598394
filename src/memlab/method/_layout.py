"""Sequences and documents -> a batch's tensors -> the completion log-probs read back from them
(``dpo``, ``kto``, ``reward``, and the online methods' training rows).

Not an option of its own (the registry skips modules whose name starts with ``_``).

**Sequences** (:func:`sequence`, :func:`collate_sequences`): a method turns its rows into a list
of sequences (``prompt + completion`` with labels on the completion only, shifted per sequence)
and collates them either padded ``[S, T]`` with an attention mask, or padding-free: one
``[1, N]`` row, position_ids restarting at every sequence, no attention mask, the row's
document ``segments``, and ``segment_ids`` naming each token's sequence.

**Documents** (packed and shared-prompt rows): a *unit* (a preference pair, a KTO example)
becomes documents (:func:`unit_docs`); the collator places them in rows (a packed micro-batch's
rows, one row per unit, or one flat row) and :func:`collate_rows` turns the rows into tensors.

* **Unshared**: one document per sequence, ``prompt + completion`` (labels shifted inside it, on
  the completion only), position ids from 0: the documents of a padded batch, side by side.
* **Shared prompt** (``method.share_prompt``): the prompt is stored once. The first completion
  continues it as one document (``prompt + chosen``); every other completion is a document of
  its own tokens only, with position ids continuing the prompt's, that also sees the prompt
  (:class:`memlab.trainer.batch.Segments` entry ``(n, a, b)``) and not the other completions.
  The prompt's last token predicts the first token of EVERY completion: the first completion's
  through its ordinary label, each other one through a *fork* label (``fork_index`` /
  ``fork_labels`` / ``fork_segments``: an extra scored token at that position).

Tensors (rows padded to the longest, or one flat row): ``input_ids``, ``labels`` (shifted, per
document; ``IGNORE`` where nothing is scored), ``segment_ids`` (the sequence each label belongs
to, -1 elsewhere), ``position_ids``, the rows' ``segments``, the fork labels, and
``last_index`` (flat index of the token a reward head reads for each sequence) when asked for.
The pad tail of a row is a plain document of its own.

**Log-probs** (:func:`completion_logps`): the summed completion log-probs of each sequence of
either layout: padded rows (one sequence per row), padding-free rows (``segment_ids``), rows of
documents (``segment_ids`` over every row, plus the fork labels of shared prompts: the prompt's
last token scored once more for each further completion), or the scored positions a batch
lists (``head_on=labelled``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from memlab.losses import forked_token_logps, segment_logps, sequence_logps, token_logps
from memlab.method.base import (
    IGNORE,
    LOSS_INDEX,
    LOSS_LABELS,
    LOSS_SEQS,
    Segments,
    flatten_batch,
    head_logits,
    model_inputs,
    pad_batch,
    round_up,
    scored_tensors,
    sequence_scored,
    shifted_labels,
)
from memlab.packing.groups import PACK_ROWS
from memlab.trainer.routing import unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext


# ---------------------------------------------------------------------------------------- sequences

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

# ---------------------------------------------------------------------------------------- documents

@dataclass
class Doc:
    """One document of a row."""

    ids: list[int]
    labels: list[int]
    """Aligned, shifted labels; ``IGNORE`` where nothing is scored."""
    seq: int
    """The sequence its labels belong to (-1: none)."""
    first_position: int = 0
    prefix: tuple[int, int] | None = None
    """``(document, tokens)``: it also sees the first ``tokens`` tokens of that document of the
    same unit (given as an offset from its own index: -1 = the document before it)."""
    fork: tuple[int, int] | None = None
    """``(label, seq)``: its first token, predicted by the prefix's last token."""
    pools: list[tuple[int, int]] = field(default_factory=list)
    """``(seq, index in this document)`` of the tokens a reward head reads."""


def unit_docs(prompt: Sequence[int], completions: Sequence[Sequence[int]], seqs: Sequence[int],
              shared: bool, scored: bool = True, pools: Sequence[int] | None = None
              ) -> list[Doc]:
    """The documents of one unit: ``prompt`` followed by each completion (``seqs``: their
    sequence indices). ``shared``: the prompt stored once (module docstring). ``scored``: labels
    on the completions (False: none, a reward model's sequences). ``pools``: per completion, the
    index within ``prompt + completion`` of the token a reward head reads."""
    p = list(prompt)
    docs: list[Doc] = []
    for i, (c, s) in enumerate(zip(completions, seqs, strict=True)):
        c = list(c)
        pool = None if pools is None else pools[i]
        if i == 0 or not shared or not p:
            ids = p + c
            labels = (shifted_labels(ids, [0] * len(p) + [1] * len(c)) if scored
                      else [IGNORE] * len(ids))
            docs.append(Doc(ids, labels, s, pools=[] if pool is None else [(s, pool)]))
            continue
        lead = -len(docs)  # the unit's first document holds the prompt
        if pool is not None and pool < len(p):  # the read token lies in the shared prompt
            docs[0].pools.append((s, pool))
        if not c:
            continue
        labels = shifted_labels(c, [1] * len(c)) if scored else [IGNORE] * len(c)
        docs.append(Doc(c, labels, s, first_position=len(p), prefix=(lead, len(p)),
                        fork=(c[0], s) if scored else None,
                        pools=[] if pool is None or pool < len(p) else [(s, pool - len(p))]))
    return docs


def collate_rows(rows: list[list[Doc]], pad_id: int, multiple: int | None, flat: bool,
                 num_seqs: int | None = None, scored: bool = False) -> tuple[dict, int, int]:
    """Tensors of ``rows`` (lists of documents; a document's ``prefix`` points into its own
    row), padded to the longest row (rounded up to ``multiple``), or, with ``flat``, every row
    concatenated into one ``[1, N]`` row. ``num_seqs``: also return ``last_index`` for sequences
    ``0 .. num_seqs-1`` (reward pooling). ``scored``: also every scored token's position, label
    and sequence (:func:`memlab.method.base.scored_tensors`; a fork listed where it is predicted,
    before the rest of its sequence, so each sequence's tokens come in order).
    Returns ``(tensors, stored tokens, slots)``."""
    if flat:
        rows = [[d for row in rows for d in row]]
    lengths = [sum(len(d.ids) for d in row) for row in rows]
    width = round_up(max(lengths), multiple)
    n_rows = len(rows)
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    labels = torch.full((n_rows, width), IGNORE, dtype=torch.long)
    seg = torch.full((n_rows, width), -1, dtype=torch.long)
    pos = torch.zeros((n_rows, width), dtype=torch.long)
    entries: list[tuple] = []
    forks: list[tuple[int, int, int]] = []
    listed: list[tuple[int, int, int]] = []  # (position, label, sequence) with ``scored``
    pooled: dict[int, int] = {}
    for r, row in enumerate(rows):
        starts: list[int] = []
        start = 0
        entry: list[int | tuple[int, int, int]] = []
        for j, d in enumerate(row):
            n = len(d.ids)
            starts.append(start)
            ids[r, start:start + n] = torch.tensor(d.ids, dtype=torch.long)
            labels[r, start:start + n] = torch.tensor(d.labels, dtype=torch.long)
            seg[r, start:start + n] = torch.tensor(
                [d.seq if lab != IGNORE else -1 for lab in d.labels], dtype=torch.long)
            pos[r, start:start + n] = torch.arange(d.first_position, d.first_position + n)
            if d.prefix is None:
                entry.append(n)
            else:
                a = starts[j + d.prefix[0]]
                entry.append((n, a, a + d.prefix[1]))
                if d.fork is not None:
                    forks.append((r * width + a + d.prefix[1] - 1, *d.fork))
                    if scored:
                        listed.append(forks[-1])
            if scored:
                base = r * width + start
                listed += [(base + i, lab, d.seq) for i, lab in enumerate(d.labels)
                           if lab != IGNORE]
            for s, i in d.pools:
                pooled[s] = r * width + start + i
            start += n
        if width > start:  # the pad tail: a document of its own
            pos[r, start:] = torch.arange(width - start)
            entry.append(width - start)
        entries.append(tuple(entry))
    t = {"input_ids": ids, "labels": labels, "segment_ids": seg, "position_ids": pos,
         "segments": Segments(entries),
         "fork_index": torch.tensor([f[0] for f in forks], dtype=torch.long),
         "fork_labels": torch.tensor([f[1] for f in forks], dtype=torch.long),
         "fork_segments": torch.tensor([f[2] for f in forks], dtype=torch.long)}
    if scored:
        t.update(scored_tensors(listed))
    if num_seqs is not None:
        missing = [s for s in range(num_seqs) if s not in pooled]
        if missing:
            raise ValueError(f"sequences {missing[:5]} have no pooled token")
        t["last_index"] = torch.tensor([pooled[s] for s in range(num_seqs)], dtype=torch.long)
    return t, sum(lengths), n_rows * width


def place(units: list[list[Doc]], rows_of: list[list[int]]) -> list[list[Doc]]:
    """Rows of a packed micro-batch: unit ``u``'s documents go to ``rows_of[u]`` (one row: the
    whole unit; one row per document: a unit split into its sequences, laid out unshared)."""
    n_rows = 1 + max(r for rows in rows_of for r in rows)
    out: list[list[Doc]] = [[] for _ in range(n_rows)]
    for docs, rows in zip(units, rows_of, strict=True):
        if len(rows) == 1:
            out[rows[0]].extend(docs)
            continue
        if len(rows) != len(docs) or any(d.prefix is not None for d in docs):
            raise ValueError("a split unit needs one row per document, laid out unshared")
        for d, r in zip(docs, rows, strict=True):
            out[r].append(d)
    return out


def units_of(items: list[dict]) -> tuple[list[dict], list[list[int]] | None]:
    """The units of a batch's dataset items and, for packed items (micro-batches of
    :mod:`memlab.packing.groups`), the row of each unit's pieces (rows of later items follow
    those of earlier ones). Unpacked items are one unit each: ``None``."""
    if not items or PACK_ROWS not in items[0]:
        return items, None
    units, rows_of, offset = [], [], 0
    for item in items:
        cols = [c for c in item if c != PACK_ROWS]
        for i, rows in enumerate(item[PACK_ROWS]):
            units.append({c: item[c][i] for c in cols})
            rows_of.append([offset + r for r in rows])
        offset += 1 + max(r for rows in item[PACK_ROWS] for r in rows)
    return units, rows_of


class PairRows(Protocol):
    """The knobs of a preference method that decide how its units are laid out in rows."""

    @property
    def max_length(self) -> int | None: ...
    @property
    def share_prompt(self) -> bool: ...


def layout_errors(method: PairRows, ctx: BuildContext) -> list[str]:
    """Checks every preference method shares for packing and ``share_prompt``."""
    errors = []
    if ctx.packing.packs and method.max_length is None:
        errors.append(f"packing={ctx.packing.name} packs rows of method.max_length tokens; set "
                      "method.max_length (e.g. method.max_length=2048)")
    if method.share_prompt:
        errors += shared_prompt_errors(ctx, "a pair's prompt once, the rejected tokens seeing it "
                                       "and not the chosen ones")
    return errors


def shared_prompt_errors(ctx, what: str) -> list[str]:
    """``method.share_prompt=true`` stores ``what``: the attention option must let a document
    see a prefix stored before it (``Attention.shares_prefix``)."""
    if ctx.attention.shares_prefix():
        return []
    return [f"method.share_prompt=true stores {what}; attention={ctx.attention.name} cannot "
            "express that in a row; use attention=sdpa or eager (attention.varlen=true) or "
            "flex_attention, or set method.share_prompt=false"]


def per_item(values: list, items: list[dict]) -> list:
    """Per-unit ``values`` (in the order :func:`units_of` gives) regrouped by dataset item: a
    packed item gets the list of its units' values, an unpacked item its own value."""
    if not items or PACK_ROWS not in items[0]:
        return values
    out, i = [], 0
    for item in items:
        n = len(item[PACK_ROWS])
        out.append(values[i: i + n])
        i += n
    return out


def unit_row(ctx: BuildContext | None, max_length: int | None) -> int | None:
    """The row a unit must fit whole (``packing=bfd``: packed, no splitting): its capacity
    ``max_length`` (which packing requires); None when units are not packed whole, or without
    a run context (a method used on its own)."""
    whole = ctx is not None and ctx.packing.packs and not ctx.packing.keeps_overflow
    return max_length if whole else None


def attention_of(ctx: BuildContext | None) -> Any:
    """The run's attention option (it builds the document masks some backends need), or None
    without a run context."""
    return None if ctx is None else ctx.attention

# ---------------------------------------------------------------------------------------- log-probs

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
    """Per-sequence sums over rows of documents (:func:`collate_rows`): every scored
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
