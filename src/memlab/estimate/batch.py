"""The batches an estimate measures: the worst-case candidates the configured data and settings
can produce (default), or the run's own micro-batches (``--from-data``).

Why candidates and not one "largest" batch: a batch's memory depends on its shapes *and* on the
path attention takes for it. Rows of different lengths make a padded batch, and a padding mask
changes the path. Measured with the run's tracker (transformers 5.23, torch 2.13, CPU): sdpa
gets a boolean ``[rows, 1, T, T]`` mask built once per forward; torch's
``scaled_dot_product_attention`` converts it to the query's dtype in every layer, and the
kernel saves that float copy for backward; transformers also passes ``enable_gqa`` only without
a mask, so with one the key / value heads are repeated to every query head and saved too.
Without checkpointing that is kept per layer until backward: 16 MiB (mask) + 2 MiB (repeated
key / value) a layer for 4 x 1024 rows of the default tiny model in fp32; with checkpointing
only the recomputed layer holds them. A batch whose rows all have the same length skips the
mask (sdpa's causal kernel); eager builds its float mask either way; flash / flex attention
build no dense mask (:func:`memlab.estimate.modes.exact_value_hooks`). Which batch is larger
therefore depends on the backend, so the estimate measures each batch that can occur and takes
the largest peak (:func:`memlab.estimate.fake.run_fake_step`).

Candidates (:func:`candidates`), every one through the method's own ``collate`` (and, for
packing, the packing strategy's own ``apply``), so shapes and masks cannot drift from a run:

- SFT-style padded rows: ``full`` = ``batch_size`` rows of ``length`` tokens (no padding) and
  ``padded`` = the same with the last row one token shorter: the same ``[batch_size, length]``
  tensors, the padding-mask path, and the most real tokens a padded batch can have (the mask's
  cost does not depend on how much padding there is; anything that grows with real tokens is
  largest). One row cannot be padded: ``batch_size=1`` has only ``full``. Where SFT sends
  padded rows without their mask (``method.padding_mask=auto`` under eager / sdpa) the padded
  candidate has one label fewer and the same tensors: ``full`` dominates it and it is dropped.
- padding-free rows (one flat row, no mask): ``full`` only (shorter rows only shrink it).
- packed rows: ``docs_per_row`` documents per row when given, else both 1 (the most attention
  work per document, with per-document kernels) and 2 (the fewest documents that make
  transformers' whole-row block mask, ``attention.varlen=false``).
- other methods (pairs, scored sequences, prompts): ``longest`` = the ``batch_size`` longest
  generated rows of the method's data kind through its own ``prepare`` (padded already where
  its sequences differ in length); ``padded`` = the same with one row one token shorter in its
  completions (methods that generate their completions: in its prompt), or, where that leaves
  no padding (a DPO pair of one row), in its last completion only, with the same shapes;
  ``widest`` = the rows with the longest value of each token column together (a collate that
  pads a prompt block and a completion block separately, like GKD's, is widest so).
- methods whose units pack in groups (preference pairs:
  :class:`~memlab.packing.groups.GroupPacked`) with packing: ``fullest pack`` = of the
  micro-batches (one item each) ``packing.apply`` makes of the ``4 * batch_size`` longest
  generated units, the one with the most token slots (``batch_size`` full rows when the pairs
  are long).

A candidate that collates to a batch needing no more memory than another one (the same mask
decisions and documents, no dimension larger: :func:`signature`, :func:`dominated`) is dropped.
``--from-data`` (:func:`run_batches`) measures the run's own micro-batches the same way: every
micro-batch its steps draw from its :class:`~memlab.trainer.batch.BatchStream`, dominated ones
dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import datasets
import torch

from memlab.data import synthetic
from memlab.estimate.options import EstimateError
from memlab.measure.data import DataStats
from memlab.method.base import Generating, layout_shapes, shifted_labels
from memlab.trainer.batch import Batch, Segments

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.trainer.epochs import StepPlan


@dataclass
class Candidate:
    """One batch the estimate measures."""

    name: str
    """Short name (``full``, ``padded``, ``1 document per row``, ``run batch 3``)."""
    rows: list[dict]
    """The prepared rows of one micro-batch (what ``method.collate`` gets); empty for a batch
    taken from the run's stream (``batch`` holds it)."""
    description: str
    batch: Batch | None = None
    """The collated batch: set when it comes from the run's own stream (``--from-data``), else
    once the pipeline has prepared the rows (:meth:`collated`)."""
    peak: int = 0
    """Its measured peak (a held-out batch's ``eval`` phase)."""

    def collated(self) -> Batch:
        """:attr:`batch`, which every candidate has by the time it is measured."""
        if self.batch is None:
            raise ValueError(f"candidate {self.name!r} was measured before it was collated")
        return self.batch


# ----------------------------------------------------------------------------- worst case


def _token_rows(lengths: list[int], token: int) -> list[dict[str, list[int]]]:
    """Prepared SFT-style rows (``input_ids`` + per-document shifted ``labels``); every token
    trains (the worst case: the loss covers all of them)."""
    rows = []
    for n in lengths:
        ids = [token] * n
        rows.append({"input_ids": ids, "labels": shifted_labels(ids, [1] * n)})
    return rows


def _split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def candidates(ctx: BuildContext, tokenizer, length: int, docs_per_row: int | None = None
               ) -> list[Candidate]:
    """The worst-case candidates of one micro-batch (module docstring), in the order measured;
    duplicates in memory are not removed here (:func:`distinct`)."""
    method, packing = ctx.method, ctx.packing
    grouped = method.as_group_packed() is not None
    if grouped and packing.packs:
        return [Candidate("fullest pack", [_largest_pack(ctx, tokenizer, length)],
                          f"the fullest of the micro-batches packing={packing.name} makes of "
                          f"the longest generated {method.data_kinds[0]} rows "
                          f"({ctx.train.batch_size} rows of up to {length} tokens)")]
    if not method.row_layout(ctx).supports_packing or grouped:
        return _generic_candidates(ctx, tokenizer, length)
    if packing.packs:
        counts = [docs_per_row] if docs_per_row else sorted({1, min(2, length)})
        return [_packed(ctx, tokenizer, length, k) for k in counts]
    return _sft_candidates(ctx, tokenizer, length)


def _sft_candidates(ctx: BuildContext, tokenizer, length: int) -> list[Candidate]:
    bs = ctx.train.batch_size
    token = min(100, len(tokenizer) - 1)
    out = [Candidate("full", _token_rows([length] * bs, token),
                     f"{bs} rows of {length} tokens")]
    if bs > 1 and length > 1 and not ctx.method.row_layout(ctx).packs_rows:
        out.append(Candidate("padded", _token_rows([length] * (bs - 1) + [length - 1], token),
                             f"{bs - 1} rows of {length} tokens + 1 of {length - 1} (padded)"))
    return out


def _packed(ctx: BuildContext, tokenizer, length: int, docs: int) -> Candidate:
    bs, packing = ctx.train.batch_size, ctx.packing
    token = min(100, len(tokenizer) - 1)
    lengths = [n for _ in range(bs) for n in _split(length, docs)]
    ds = datasets.Dataset.from_list(_token_rows(lengths, token))
    ds, _ = packing.apply(ds, DataStats(rows=len(ds), examples=len(ds)), ctx)
    rows = [ds[i] for i in range(min(bs, len(ds)))]
    while len(rows) < bs:
        rows.append(rows[len(rows) % len(ds)])
    name = f"{docs} document{'s' if docs > 1 else ''} per row"
    return Candidate(name, rows, f"{bs} packed rows of {length} tokens, {name} "
                                 f"(packing={packing.name})")


def _largest_pack(ctx: BuildContext, tokenizer, length: int) -> dict:
    """The packed item (one micro-batch) that collates to the most token slots (then real
    tokens), of the ``4 * batch_size`` longest generated units packed by the run's option."""
    more = dataclasses.replace(ctx, train=dataclasses.replace(
        ctx.train, batch_size=4 * ctx.train.batch_size))
    ds = _generic_prepared(more, tokenizer, length)
    size = _sizes(ctx, ds)
    order = sorted(range(len(ds)), key=lambda i: -size[i])
    units = datasets.Dataset.from_list(_pick(ds, order, 4 * ctx.train.batch_size))
    packed, _ = ctx.packing.apply(units, DataStats(rows=len(units), examples=len(units)), ctx)
    items = [packed[i] for i in range(len(packed))]
    sizes = [(b.total_tokens, b.real_tokens)
             for b in (ctx.method.collate([item], tokenizer, ctx) for item in items)]
    return items[max(range(len(items)), key=sizes.__getitem__)]


def _generic_prepared(ctx: BuildContext, tokenizer, length: int):
    """Generated rows of the method's data kind around ``length`` tokens through its own
    ``prepare`` (format, tokenize, truncate or drop)."""
    kind = ctx.method.data_kinds[0]
    gen = {"chat": synthetic.generate_chat, "text": synthetic.generate_text,
           "preference": synthetic.generate_preference}[kind]
    bs = ctx.train.batch_size
    parts = []
    for median in (2 * length, length):  # longer than max_length (truncated) and around it
        raw = datasets.Dataset.from_list(gen(max(32, 4 * bs), seed=0, median_tokens=median,
                                             max_tokens=4 * length, sigma=0.3))
        part, _ = ctx.method.prepare(raw, tokenizer, ctx)
        if len(part):
            parts.append(part)
    if not parts:
        raise EstimateError(f"method={ctx.method.name} kept none of the generated rows at "
                            f"length {length}; pass --length")
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def _token_columns(row: dict) -> list[str]:
    return [c for c, v in row.items() if (c.endswith("_ids") or c == "input_ids")
            and isinstance(v, list)]


def _sizes(ctx: BuildContext, ds) -> list[int]:
    """Tokens of each prepared row: all its token columns (methods that generate their
    completions: its prompt)."""
    cols = _token_columns(ds[0])
    online = ctx.method.as_generating() is not None
    sized = ["prompt_ids"] if online and "prompt_ids" in cols else cols
    lens = [ds[c] for c in sized]
    return [sum(len(col[i]) for col in lens) for i in range(len(ds))]


def _pick(ds, order: list[int], bs: int) -> list[dict]:
    rows = [ds[i] for i in order[:bs]]
    while len(rows) < bs:
        rows.append(rows[len(rows) % len(order)])
    return rows


def _shorter(rows: list[dict], i: int, columns: list[str]) -> list[dict]:
    """``rows`` with the last token of ``columns`` dropped in row ``i``."""
    row = dict(rows[i])
    for c in columns:
        if len(row[c]) > 1:
            row[c] = row[c][:-1]
    return [*rows[:i], row, *rows[i + 1:]]


def _padded_variant(ctx: BuildContext, tokenizer, rows: list[dict], cols: list[str]
                    ) -> tuple[int, list[str], list[dict]] | None:
    """The rows with one token less in one row, collated to the same shapes as ``rows`` with
    padding: every completion column of a row (methods that generate their completions: its
    prompt), else its last completion column only (one pair: its rejected answer), trying the
    rows from the last; None if no such batch exists (one sequence per batch, padding-free)."""
    if ctx.method.as_generating() is not None:
        tried = [["prompt_ids"]] if "prompt_ids" in cols else [cols]
    else:
        rest = [c for c in cols if c != "prompt_ids"] or cols
        tried = [rest, rest[-1:]]
    shapes = layout_shapes(ctx.method.collate(rows, tokenizer, ctx).tensors)
    for i in reversed(range(len(rows))):
        for columns in tried:
            shorter = _shorter(rows, i, columns)
            t = ctx.method.collate(shorter, tokenizer, ctx).tensors
            if padded(t) and shapes == layout_shapes(t):
                return i, columns, shorter
    return None


def _generic_candidates(ctx: BuildContext, tokenizer, length: int) -> list[Candidate]:
    ds = _generic_prepared(ctx, tokenizer, length)
    bs, kind = ctx.train.batch_size, ctx.method.data_kinds[0]
    cols = _token_columns(ds[0])
    lens = {c: [len(x) for x in ds[c]] for c in cols}
    total = _sizes(ctx, ds)
    by_total = sorted(range(len(ds)), key=lambda i: -total[i])
    rows = _pick(ds, by_total, bs)
    what = f"generated {kind} rows through method.prepare (max_length={length})"
    out = [Candidate("longest", rows, f"the {len(rows)} longest {what}")]
    variant = _padded_variant(ctx, tokenizer, rows, cols)
    if variant is not None:
        i, columns, shorter = variant
        out.append(Candidate("padded", shorter, f"{out[0].description}, row {i + 1} one token "
                                                f"shorter in {', '.join(columns)} (padded)"))
    if len(cols) > 1 and bs > 1:  # a collate that pads columns separately (a prompt block and
        # a completion block) is widest with the longest of each column in one batch
        def longest_in(col: list[int]) -> int:
            return max(range(len(ds)), key=lambda i: (col[i], total[i]))

        widest = [longest_in(lens[c]) for c in cols]
        order = list(dict.fromkeys(widest + by_total))
        out.append(Candidate("widest", _pick(ds, order, bs),
                             f"the {kind} rows with the longest {', '.join(cols)} and the "
                             f"longest others ({what})"))
    return out


# ----------------------------------------------------------------------------- batches


def padded(tensors: dict[str, Any]) -> bool:
    """Whether a collated batch carries a padding mask with padding in it (the mask path)."""
    return any(k.endswith("mask") and isinstance(v, torch.Tensor) and not v.is_floating_point()
               and bool((v == 0).any()) for k, v in tensors.items())


def signature(batch: Batch) -> tuple:
    """What a batch's memory in a fake step depends on: its tensors' shapes, which padding
    masks hold padding, and the documents of packed rows (values are never read otherwise)."""
    t = batch.tensors
    shapes = tuple(sorted((k, tuple(v.shape)) for k, v in t.items()
                          if isinstance(v, torch.Tensor)))
    masks = tuple(sorted(k for k, v in t.items() if padded({k: v})))
    segs = tuple(sorted((k, tuple(v)) for k, v in t.items() if isinstance(v, Segments)))
    return shapes, masks, segs


def dominated(a: tuple, b: tuple) -> bool:
    """Whether a batch of signature ``a`` needs no more memory than one of ``b``: the same
    tensors, mask decisions and documents, every dimension at most ``b``'s."""
    (sa, ma, da), (sb, mb, db) = a, b
    if ma != mb or da != db or [k for k, _ in sa] != [k for k, _ in sb]:
        return False
    return all(len(x) == len(y) and all(i <= j for i, j in zip(x, y, strict=True))
               for (_, x), (_, y) in zip(sa, sb, strict=True))


def distinct(items: list[Any], key: Callable[[Any], Batch]) -> list[Any]:
    """``items`` without those whose batch another one dominates (the first of equals kept)."""
    sigs = [signature(key(x)) for x in items]
    keep = []
    for i, s in enumerate(sigs):
        beaten = any(j != i and dominated(s, t) and (s != t or j < i)
                     for j, t in enumerate(sigs))
        if not beaten:
            keep.append(items[i])
    return keep


def run_micro_batches(ctx: BuildContext, plan: StepPlan) -> int:
    """How many micro-batches a run of ``plan``'s steps draws from its stream: ``grad_accum``
    per step (an online method: per generation batch, one every ``num_iterations`` steps);
    ``train.epochs``: every pass's micro-batches."""
    if plan.micro_batches is not None:
        return plan.micro_batches
    steps = plan.steps
    online = ctx.method.as_generating()
    if online is not None:
        steps = math.ceil(steps / max(1, online.num_iterations))
    return steps * ctx.train.grad_accum


def run_batches(stream, ctx: BuildContext, plan: StepPlan) -> list[Candidate]:
    """Every micro-batch of the run's steps from its own :class:`BatchStream` (this rank's
    slice), in order, as candidates (dominated ones removed)."""
    n = run_micro_batches(ctx, plan)
    items = [Candidate(f"run batch {i}", [], describe_rows(b), batch=b)
             for i, b in ((i, next(stream)) for i in range(n))]
    return distinct(items, key=lambda c: c.batch)


def describe_rows(batch: Batch) -> str:
    t = batch.tensors
    ids = t.get("input_ids", t.get("prompt_ids"))
    shape = "x".join(map(str, ids.shape)) if isinstance(ids, torch.Tensor) else "?"
    return (f"{batch.real_tokens} real tokens in [{shape}]"
            + (" (padded)" if padded(t) else ""))


def trained_batch(batch: Batch) -> dict[str, Any]:
    """What is kept of a measured batch (no tensor): its shapes and token counts."""
    return {"shapes": {k: list(v.shape) for k, v in batch.tensors.items()
                       if isinstance(v, torch.Tensor)},
            "tokens": int(batch.total_tokens), "real_tokens": int(batch.real_tokens)}


def describe_batch(trained: dict[str, Any], ctx: BuildContext, rows_desc: str, length: int | None,
                   is_padded: bool) -> dict[str, Any]:
    """The ``batch`` section of estimate.json for a :func:`trained_batch`."""
    return {
        "rows": rows_desc,
        **trained,
        "padded": is_padded,
        "length": None if length is None else int(length),
        "batch_size": int(ctx.train.batch_size),
        "collate": ("padding-free (one flat row)" if ctx.method.row_layout(ctx).packs_rows
                    else "padded"),
    }


def new_tokens(method: Generating) -> int:
    """Tokens an online method generates per completion."""
    return method.sampling_length()


def worst_case_rollout_tensors(method: Generating, batch: Batch, token: int, ctx: BuildContext
                               ) -> dict[str, torch.Tensor]:
    """The real values of the worst-case generated training batch of the prompt ``batch``
    (every completion runs to its full length, the method's own layout): the candidates
    :func:`exact_value_hooks` evaluates the training forward's mask decisions on, as it does
    for collated batches."""
    if "prompt_ids" not in batch.tensors:
        return {}
    t = method.worst_case_tensors(batch, new_tokens(method), token, ctx)
    return {f"rollout_{k}": v for k, v in t.items() if isinstance(v, torch.Tensor)}
