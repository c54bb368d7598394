"""The training batch of a rollout (the online methods' prompts and sampled completions), and
the per-token values a loss reads from it.

Not an option of its own. The batch is laid out on the host from token lists (the prompts the
collator kept in ``meta``, the completions the engine copied to the host), so its shapes and its
scored positions are exact without reading a device tensor (an estimate's fake step included):

* **padded** (default): one row per completion, ``prompt + completion`` right-padded to the
  longest; without an attention mask where the backend computes padded positions anyway
  (``method.padding_mask=auto`` under eager / sdpa: :func:`memlab.method.base.drops_padding_mask`);
* **padding-free** (``method.padding_free``): every ``prompt + completion`` a document of one
  ``[1, N]`` row (position ids restarting, the row's segments);
* **shared prompt** (``method.share_prompt``): one row per prompt, the prompt stored once and its
  completions after it, each seeing the prompt and itself only (:mod:`memlab.method._layout`,
  as a preference pair's shared prompt; with ``padding_free`` every group in one row). The
  prompt's last token predicts the first token of every completion (a *fork* for all but the
  first), so the training forward and backward pay for each prompt once, not once per
  completion, with the log-probs of the unshared batch.

Scored tokens: token ``t`` of completion ``i`` is predicted by one position of the rows. The
batch lists them in completion order (:data:`~memlab.method.base.LOSS_INDEX` with their labels
and completions) and :data:`COMPLETION_INDEX` = ``i * L + t``, their cell of the ``[N, L]``
completion grid (``completion_mask``) where per-token values live: log-probs, the old log-probs
of ``num_iterations``, importance weights, a value model's values. ``head_on=labelled`` runs
the output head (and a value head) at the listed positions only; ``all`` over every position,
then reads them (the reference it is tested against).

A completion whose loss term is zero whatever the policy (its method says so: GRPO with
``beta=0`` and RLOO when its advantage is exactly 0; a truncated completion left out by
``mask_truncated_completions``) is not placed in the batch at all; a prompt with none left goes
too. The loss normaliser still counts it (it is computed before), so loss and gradients are
those of the full batch. A batch keeps at least one completion (every rank runs a forward and
a backward).
"""

from __future__ import annotations

from typing import Any

import torch

from memlab.losses import token_logps
from memlab.method import _collate, _layout, _logps
from memlab.method.base import LOSS_INDEX, LOSS_LABELS, head_logits
from memlab.trainer.routing import base_model, call_inside

COMPLETION_INDEX = "completion_index"
"""Batch tensor: the ``[N, L]`` completion-grid cell (``i * L + t``) of each scored token, in
the order of :data:`~memlab.method.base.LOSS_INDEX`."""

_LAYOUT_ONLY = ("labels", "segment_ids", "fork_index", "fork_labels", "fork_segments",
                "last_index")
"""Tensors of the shared collators that the online losses do not read (the scored tokens say
it all)."""


def training_tensors(prompts: list[list[int]], completions: list[list[int]], keep: list[bool],
                     group: int, pad_id: int, *, share: bool, flat: bool, mask: bool,
                     width: int | None = None) -> tuple[dict[str, Any], int, int]:
    """The training tensors of ``prompts`` (``B``) and their ``completions`` (``B * group``,
    prompt-major), placing the completions ``keep`` marks (module docstring; with none, the
    first one, unscored: its ``completion_mask`` row is 0).
    ``width``: the completion grid's width (default: the longest completion). Returns
    ``(tensors, stored tokens, token slots)``."""
    n = len(completions)
    if n != len(prompts) * group or len(keep) != n:
        raise ValueError(f"{len(prompts)} prompts x {group} completions != {n} completions "
                         f"({len(keep)} keep flags)")
    if any(not p for p in prompts):
        raise ValueError("an empty prompt predicts no first completion token")
    kept = [i for i in range(n) if keep[i]]
    placed = kept or [0]  # at least one row; unscored (its completion_mask row stays 0)
    if share:
        units = []
        for b, prompt in enumerate(prompts):
            mine = [i for i in placed if i // group == b]
            if mine:
                units.append(_layout.unit_docs(prompt, [completions[i] for i in mine], mine,
                                               shared=True))
        t, real, total = _layout.collate_rows(units, pad_id, None, flat, scored=True)
    else:
        seqs = [_collate.sequence(prompts[i // group], completions[i]) for i in placed]
        t, real, total = _collate.collate_sequences(seqs, pad_id, None, flat, scored=True,
                                                    seq_ids=placed)
        if not mask:
            t.pop("attention_mask", None)
    for k in _LAYOUT_ONLY:
        t.pop(k, None)
    width = width or max(len(c) for c in completions)
    # the collators list the kept completions in order, each one's tokens in order
    cells = [i * width + j for i in placed for j in range(len(completions[i]))]
    if len(cells) != t[LOSS_INDEX].numel():
        raise AssertionError(f"{t[LOSS_INDEX].numel()} scored positions for {len(cells)} "
                             "completion tokens")
    grid = torch.zeros((n, width), dtype=torch.long)
    for i in kept:
        grid[i, : len(completions[i])] = 1
    t[COMPLETION_INDEX] = torch.tensor(cells, dtype=torch.long)
    t["completion_mask"] = grid
    return t, real, total


def grid(values: torch.Tensor, t: dict[str, Any]) -> torch.Tensor:
    """Per-scored-token ``values`` ``[K]`` as the ``[N, L]`` completion grid (0 elsewhere)."""
    n, width = t["completion_mask"].shape
    return values.new_zeros(n * width).index_copy(0, t[COMPLETION_INDEX], values).view(n, width)


def completion_logps(model, t: dict[str, Any], labelled: bool, attention: Any = None
                     ) -> torch.Tensor:
    """``[N, L]`` fp32 log-probs of the completion tokens under ``model`` (0 where nothing is
    scored); ``labelled``: the output head runs at the scored positions only."""
    inputs = _logps.document_inputs(t, "", attention)
    logits = head_logits(model, inputs, t[LOSS_INDEX], labelled)
    return grid(token_logps(logits, t[LOSS_LABELS]), t)


def _values(model, index: torch.Tensor, labelled: bool, **inputs: Any) -> torch.Tensor:
    base = base_model(model)
    hidden = getattr(base, base.base_model_prefix)(**inputs, use_cache=False).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])
    score = base.get_submodule("score")  # the value head
    if labelled:
        return score(hidden.index_select(0, index)).squeeze(-1).float()
    return score(hidden).squeeze(-1).float().index_select(0, index)


def completion_values(model, t: dict[str, Any], labelled: bool, attention: Any = None
                      ) -> torch.Tensor:
    """``[N, L]`` a value model's output at the positions that predict the completion tokens
    (its one-output head on each hidden state, not pooled at the last token as the
    classification forward does); ``labelled``: the head runs there only."""
    inputs = _logps.document_inputs(t, "", attention)
    return grid(call_inside(model, _values, t[LOSS_INDEX], labelled, **inputs), t)
