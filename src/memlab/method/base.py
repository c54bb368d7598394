"""The shape of a method (:class:`Method`: its Protocol, with :class:`Generating` and
:class:`ModelFactory`, is in :mod:`memlab.protocols` and re-exported here) and the batch helpers
methods share.

A method is a registered dataclass (configuration only: no run-time state) with:

- ``data_kinds``: the row kinds it trains on ('chat', 'text', 'preference'), first = default;
- ``head``: 'causal_lm' or 'seq_cls';
- ``validate(ctx) -> list[str]``;
- ``prepare(ds, tokenizer, ctx) -> (ds, DataStats)``: format -> tokenize -> truncate -> labels
  (packing is applied after this by the pipeline, when the method allows it);
- ``collate(rows, tokenizer, ctx) -> Batch``;
- ``loss(models, batch, ctx) -> (loss_sum, metrics)``: the loss *summed* over the batch's
  ``num_items`` (tokens for SFT, pairs for DPO); the trainer divides by the items of the whole
  optimizer step, so gradient accumulation does not change the gradient;
- ``row_layout(ctx) -> RowLayout``: how its rows are laid out in the run (whether packing and
  padding-free apply, whether its collated rows hold several sequences, which the attention
  option must keep apart, the longest row, the padded width's multiple, which end truncation
  keeps);
- ``evaluate(models, batch, ctx, env) -> (sums, items)`` and ``eval_metrics``: its metrics on
  a held-out micro-batch (no gradients), summed over the batch's items, so that the trainer's
  evaluation adds them up over the whole held-out set and every rank before dividing
  (:mod:`memlab.trainer.evaluate`): the loss and the loss's metrics for methods that train on
  a dataset (:func:`loss_sums`), the reward of greedy completions for online methods.

Declared capabilities (None: the method does not have it; :class:`NoCapabilities` holds the
None answers, every method extends it):

- ``as_generating() -> Generating | None``: it samples its training batches (online methods):
  ``rollout(models, batch, ctx, env)``, ``num_iterations``, ``supports_sampling_correction``...
  (:class:`Generating`);
- ``as_group_packed() -> GroupPacked | None``: its rows pack as units of several sequences
  (preference pairs; :class:`memlab.protocols.GroupPacked`, :mod:`memlab.packing.groups`);
- ``as_liger() -> LigerUser | None``: it has a Liger path (sft, dpo, kto): ``uses_liger()``,
  ``liger_model_kernels()``, and ``reads_head_weight(ctx)``, the setting whose loss reads the
  output head's weight directly (Liger's fused losses, sft's chunked one);
- ``as_extra_models() -> ExtraModels | None``: it needs models besides the policy:
  ``extra_models(policy, ctx, build) -> dict`` (e.g. a DPO reference), built by ``build``
  (:class:`ModelFactory`); ``trains_extra_models`` (PPO's value model); and
  ``before_training(models, ds, ctx) -> ds | None``, a one-off pass (e.g. cache reference
  log-probs) that returns the dataset with the columns it added, or None to keep ``ds``;
- ``as_pinnable() -> Pinnable | None``: it has choices that depend on the rest of the run (an
  ``auto``): ``pinned(ctx)`` makes them explicit, for an estimate that measures the run in
  another context (sft's ``loss_impl``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

from memlab import registry
from memlab.losses import IGNORE, TiedWeightGrad
from memlab.measure.data import DataStats
from memlab.protocols import (
    ExtraModels,
    Generating,
    GroupPacked,
    LigerUser,
    Method,
    ModelFactory,
    Pinnable,
    RowLayout,
)
from memlab.registry import Option
from memlab.trainer.batch import Batch, Segments
from memlab.trainer.routing import unwrap

if TYPE_CHECKING:
    from memlab.protocols import BuildContext

__all__ = ["IGNORE", "Batch", "DataStats", "ExtraModels", "Generating", "LigerUser", "Method",
           "ModelFactory", "NoCapabilities", "Offline", "Pinnable", "RowLayout", "Segments",
           "decoder_hidden", "flatten_batch", "head_logits", "loss_sums", "model_inputs",
           "pad_batch", "register", "round_up", "scored_tensors", "shifted_labels"]


def loss_sums(method: Method, models: dict, batch: Batch, ctx: BuildContext
              ) -> tuple[dict[str, float], int]:
    """:meth:`Method.evaluate` of a method whose evaluation is its loss: the loss sum and
    each of its ``eval_metrics`` (means over the batch's items) times the items."""
    loss_sum, metrics = method.loss(models, batch, ctx)
    n = batch.num_items
    sums = {"loss": float(loss_sum)}
    sums.update({k: float(v) * n for k, v in metrics.items() if k in method.eval_metrics})
    return sums, n


MethodClass = TypeVar("MethodClass", bound=Method)


def register(name: str) -> Callable[[type[MethodClass]], type[MethodClass]]:
    """Register a ``method=`` option (mypy checks it against :class:`Method`)."""
    return registry.register("method", name)


class NoCapabilities(Option):
    """The neutral answers: none of the optional capabilities (each ``as_<capability>()``
    answers None). Every method extends it and overrides the capabilities it has, returning
    itself (so mypy checks it against that capability's Protocol)."""

    def as_generating(self) -> Generating | None:
        return None

    def as_group_packed(self) -> GroupPacked | None:
        return None

    def as_liger(self) -> LigerUser | None:
        return None

    def as_extra_models(self) -> ExtraModels | None:
        return None

    def as_pinnable(self) -> Pinnable | None:
        return None


class Offline(NoCapabilities):
    """Defaults of the methods that train on a fixed dataset (mixed into their dataclasses)."""

    eval_metrics: ClassVar[tuple[str, ...]] = ("loss",)

    def evaluate(self, models, batch, ctx, env) -> tuple[dict[str, float], int]:
        return loss_sums(self, models, batch, ctx)  # type: ignore[arg-type]


def decoder_hidden(model, **inputs: Any) -> torch.Tensor:
    """Final hidden states of a causal LM's decoder, no logits (for chunked / fused losses).
    Methods run it through ``memlab.trainer.routing.call_inside`` so that it stays inside a
    distributed wrapper's forward."""
    return model.get_decoder()(**inputs, use_cache=False).last_hidden_state


@contextlib.contextmanager
def tied_head_grad(model: nn.Module, weight: torch.Tensor) -> Iterator[TiedWeightGrad | None]:
    """Within the block, where the output head's ``weight`` (read by a chunked loss) is the
    input embedding's (tied embeddings) and gets a gradient: the embedding module looks its
    ids up through the yielded :class:`~memlab.losses.TiedWeightGrad`, which the loss hands
    the weight's gradient to (``weight_grad_to``), so that backward keeps one weight-sized
    gradient of it, not the head's, the embedding's and their sum. None (nothing changed)
    where the weight is not tied, gets no gradient, or the embedding is not a plain
    ``nn.Embedding`` with a dense gradient (an adapter, a scaled or quantized one) or already
    has its forward replaced, and in a distributed run."""
    embed = unwrap(model).get_input_embeddings()
    # one process only: a sharded or replicated weight's gradient is the wrapper's to reduce
    # (FSDP2 / DeepSpeed hooks; their runs use the standard loss by default anyway)
    if not (torch.is_grad_enabled() and weight.requires_grad and type(embed) is nn.Embedding
            and not torch.distributed.is_initialized()
            and embed.weight is weight and embed.max_norm is None
            and not embed.scale_grad_by_freq and not embed.sparse
            and "forward" not in vars(embed)):
        yield None
        return
    sink = TiedWeightGrad()

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return sink.embedding(embed, ids)

    # the instance's forward: the module's own hooks (the memory tracker's) run as before
    embed.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield sink
    finally:
        del embed.forward


LOSS_INDEX = "loss_index"
"""Batch tensor: the flat positions (into ``labels.reshape(-1)``) that carry a label, found by
the collator on the host. A loss that runs the output head only there (:func:`head_at`) then
never computes logits for prompt or padding positions; its shape is known before the step, so
an estimate's fake step measures it like any input."""


LOSS_LABELS = "loss_labels"
"""Batch tensor beside :data:`LOSS_INDEX` where a position may carry more than one label (a
shared prompt's last token predicts the first token of every completion after it): the label
scored at each listed position (``LOSS_INDEX`` then lists that position once per label)."""

LOSS_SEQS = "loss_seqs"
"""Batch tensor beside :data:`LOSS_INDEX`: the sequence each scored token belongs to (a
preference pair's chosen / rejected, a rollout's completion)."""

SCORED_KEYS = (LOSS_INDEX, LOSS_LABELS, LOSS_SEQS)


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """:data:`LOSS_INDEX` of collated ``labels`` (host tensors, in the collator)."""
    return (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)


def scored_tensors(scored: list[tuple[int, int, int]], prefix: str = "") -> dict[str, Any]:
    """:data:`LOSS_INDEX`, :data:`LOSS_LABELS` and :data:`LOSS_SEQS` (named with ``prefix``)
    from ``(flat position, label, sequence)`` of each scored token, which collators list in
    plain Python while they lay the rows out: no value is read back from a tensor, so the
    shapes are exact even where the tensors hold no values (an estimate's fake step)."""
    cols = list(zip(*scored, strict=True)) if scored else [(), (), ()]
    return {prefix + k: torch.tensor(list(c), dtype=torch.long)
            for k, c in zip(SCORED_KEYS, cols, strict=True)}


def sequence_scored(labels: list[list[int]], starts: list[int], seqs: list[int] | None = None
                    ) -> list[tuple[int, int, int]]:
    """``(flat position, label, sequence)`` of the labelled tokens of sequences laid out from
    flat offsets ``starts`` (padded rows: ``row * width``; one flat row: their running sum);
    ``seqs`` names each sequence (default: its index)."""
    seqs = list(range(len(labels))) if seqs is None else seqs
    return [(start + j, lab, s) for lab_row, start, s in zip(labels, starts, seqs, strict=True)
            for j, lab in enumerate(lab_row) if lab != IGNORE]


def layout_shapes(tensors: dict[str, Any]) -> dict[str, torch.Size]:
    """Shapes of a batch's tensors that follow its layout (rows x width), not its labels."""
    return {k: v.shape for k, v in tensors.items()
            if isinstance(v, torch.Tensor) and not k.endswith(SCORED_KEYS)}


def batch_key(t: dict[str, Any], real: int, total: int, flat: bool) -> tuple[int, ...]:
    """A collated batch's size key (what ``measure.memory_steps=auto`` compares): its token
    slots and width; with a padding mask, whether it pads (the mask path is the larger one);
    with :data:`LOSS_INDEX`, the scored positions (the head's logits grow with them)."""
    key: tuple[int, ...] = (total,) if flat else (total, t["input_ids"].shape[1])
    if "attention_mask" in t:
        key = (*key, int(real < total))
    if LOSS_INDEX in t:
        key = (*key, t[LOSS_INDEX].numel())
    return key


def drops_padding_mask(padding_mask: str, ctx) -> bool:
    """Whether right-padded rows go to the model without their attention mask
    (``method.padding_mask=auto`` where the backend computes padded positions anyway:
    ``Attention.skips_padding`` false). In a causal model no real token attends to a later
    position, so the mask changes nothing a label sees; without it sdpa takes its causal
    kernel. Without a run context (a method used on its own) the mask is kept."""
    return padding_mask == "auto" and ctx is not None and not ctx.attention.skips_padding


def head_logits(model: nn.Module, inputs: dict[str, Any], index: torch.Tensor,
                labelled: bool) -> torch.Tensor:
    """``[len(index), V]`` logits at the flat positions ``index`` of the model's output:
    ``labelled``: the head runs there only (:func:`head_at`); else over every position, then
    those rows are read (``head_on=all``, the reference the labelled head is tested against).
    ``index`` may list a position more than once (a shared prompt's forks)."""
    if labelled:
        with head_at(model, index):
            return model(**inputs, use_cache=False).logits
    logits = model(**inputs, use_cache=False).logits
    return logits.reshape(-1, logits.shape[-1]).index_select(0, index)


@contextlib.contextmanager
def head_at(model: nn.Module, index: torch.Tensor | None) -> Iterator[None]:
    """Within the block the model's output head sees only the flat positions ``index`` of its
    input: ``[B, T, H]`` hidden states become ``[len(index), H]`` before the head, so the
    model's own forward returns ``[len(index), V]`` logits, after whatever it applies to them
    (Gemma's soft-capping, Cohere's scale, Granite's divisor: those are per position). A forward
    pre-hook on the unwrapped model's output embeddings (a LoRA-wrapped head included), added
    for the block only; None = every position."""
    if index is None:
        yield
        return

    def select(_module: nn.Module, args: tuple) -> tuple:
        hidden, *rest = args
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, index), *rest)

    handle = unwrap(model).get_output_embeddings().register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def model_inputs(t: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The model's keyword arguments from batch tensors ``t`` (those named ``prefix`` + input_ids
    / attention_mask / position_ids, and the rows' document ``segments`` as
    ``memlab_segments``, which memlab's per-document attention reads)."""
    out = {k: t[prefix + k] for k in MODEL_INPUTS if prefix + k in t}
    if prefix + "segments" in t:
        out["memlab_segments"] = t[prefix + "segments"]
    return out


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
) -> tuple[dict[str, Any], int, int]:
    """Right-pad ``rows`` to the longest row (rounded up to ``multiple``).

    ``columns`` maps per-token column -> pad value. Without ``with_positions`` an
    attention_mask is returned; with it (packed rows, which carry ``seq_lengths``), the rows'
    document ``segments`` (the padding tail one more) and ``position_ids`` restarting at each
    document are built here, once, and no attention_mask is given (each document is isolated
    by its segments).
    Returns (tensors, real tokens, total slots).
    """
    lengths = [len(r["input_ids"]) for r in rows]
    width = round_up(max(lengths), multiple)
    out: dict[str, Any] = {}
    for col, pad in columns.items():
        t = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : lengths[i]] = torch.tensor(r[col], dtype=torch.long)
        out[col] = t
    if with_positions:
        segs = Segments.from_lengths([list(r["seq_lengths"]) + [width - n]
                                      for r, n in zip(rows, lengths, strict=True)])
        out["position_ids"] = torch.tensor(segs.positions(), dtype=torch.long)
        out["segments"] = segs
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
) -> tuple[dict[str, Any], int, int]:
    """Padding-free: every row of the batch concatenated into one [1, N] row, position_ids
    restarting at each document (a packed row's documents: its ``seq_lengths``), no attention
    mask, and the row's document ``segments``. A pad tail (for ``multiple``) gets its own
    restarting positions and ignored labels."""
    cols: dict[str, list[int]] = {c: [] for c in columns}
    docs: list[int] = []
    for r in rows:
        for c in columns:
            cols[c].extend(r[c])
        docs.extend(r["seq_lengths"] if "seq_lengths" in r else [len(r["input_ids"])])
    real = sum(docs)
    width = round_up(real, multiple)
    tail = width - real
    for c, pad in columns.items():
        cols[c].extend([pad] * tail)
    segs = Segments.from_lengths([[*docs, tail]])
    out: dict[str, Any] = {c: torch.tensor([v], dtype=torch.long) for c, v in cols.items()}
    out["position_ids"] = torch.tensor(segs.positions(), dtype=torch.long)
    out["segments"] = segs
    return out, real, width

