"""The worst-case batch of an estimate: the prepared rows one micro-batch can hold at most.

Synthetic rows of the right lengths go through the method's own ``collate`` (and, for packing,
the packing strategy's own ``apply``), so shapes cannot drift from real runs: SFT-style methods
(those that pack) get ``batch_size`` rows of ``length`` tokens (padded: ``[batch_size, L]``;
padding-free / packed: one ``[1, batch_size * L]`` row whose documents restart position_ids,
``docs_per_row`` documents per packed row, default 1: the worst case for per-document
attention); other methods get generated rows of their data kind through their own ``prepare``
(the ``batch_size`` longest); methods whose units pack in groups (preference pairs) with
packing get the ``4 * batch_size`` longest such rows through ``packing.apply`` and the
micro-batch with the most token slots (``batch_size`` full rows when the pairs are long).
``length`` = ``method.max_length`` unless given, or the longest real row with ``from_data``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import datasets
import torch

from memlab.data import synthetic
from memlab.estimate.options import EstimateError
from memlab.measure.data import DataStats
from memlab.method._online import join
from memlab.method.base import shifted_labels
from memlab.packing.groups import GroupPacked
from memlab.pipeline import prepare_data


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


def longest_real_row(ctx, tokenizer) -> int:
    """Tokens of the longest row of the real prepared data (``--from-data``)."""
    ds, _ = prepare_data(ctx, tokenizer)
    if "input_ids" not in ds.column_names:
        raise EstimateError("from_data needs prepared rows with input_ids (method=sft-style)")
    return max(len(x) for x in ds["input_ids"])


def synthetic_rows(ctx, tokenizer, length: int, docs_per_row: int = 1
                   ) -> tuple[list[dict], str]:
    """The worst-case prepared rows of one micro-batch (what ``method.collate`` gets) and a
    description of them."""
    method, packing, bs = ctx.method, ctx.packing, ctx.train.batch_size
    token = min(100, len(tokenizer) - 1)
    if isinstance(method, GroupPacked) and packing.packs:
        return ([_largest_pack(ctx, tokenizer, length)],
                f"the fullest of the micro-batches packing={packing.name} makes of the longest "
                f"generated {method.data_kinds[0]} rows ({bs} rows of up to {length} tokens)")
    if not method.supports_packing or isinstance(method, GroupPacked):
        rows = _generic_rows(ctx, tokenizer, length)
        return rows, (f"{len(rows)} longest generated {ctx.method.data_kinds[0]} rows through "
                      f"method.prepare (max_length={length})")
    if not packing.packs:
        return _token_rows([length] * bs, token), f"{bs} rows of {length} tokens"
    docs = [n for _ in range(bs) for n in _split(length, docs_per_row)]
    ds = datasets.Dataset.from_list(_token_rows(docs, token))
    ds, _ = packing.apply(ds, DataStats(rows=len(ds), examples=len(ds)), ctx)
    rows = [ds[i] for i in range(min(bs, len(ds)))]
    while len(rows) < bs:
        rows.append(rows[len(rows) % len(ds)])
    return rows, (f"{bs} packed rows of {length} tokens, {docs_per_row} document(s) each "
                  f"(packing={packing.name})")


def describe_batch(batch, ctx, rows_desc: str, length: int) -> dict[str, Any]:
    return {
        "rows": rows_desc,
        "shapes": {k: list(v.shape) for k, v in batch.tensors.items()
                   if isinstance(v, torch.Tensor)},
        "tokens": int(batch.total_tokens),
        "real_tokens": int(batch.real_tokens),
        "length": int(length),
        "batch_size": int(ctx.train.batch_size),
        "collate": "padding-free (one flat row)" if ctx.method.packs_rows(ctx) else "padded",
    }


def _generic_rows(ctx, tokenizer, length: int) -> list[dict]:
    """Any method: generated rows of its data kind around ``length`` tokens through its own
    ``prepare`` (format, tokenize, truncate or drop); the ``batch_size`` longest prepared rows
    (repeated if fewer survive)."""
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
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    ids = [c for c in ds.column_names if c.endswith("_ids") or c == "input_ids"]
    if ctx.method.generates() and "prompt_ids" in ids:  # completions come from generation
        ids = ["prompt_ids"]
    size = [sum(len(ds[i][c]) for c in ids) for i in range(len(ds))]
    order = sorted(range(len(ds)), key=lambda i: -size[i])[:bs]
    rows = [ds[i] for i in order]
    while len(rows) < bs:
        rows.append(rows[len(rows) % len(order)])
    return rows


def _largest_pack(ctx, tokenizer, length: int) -> dict:
    """The packed item (one micro-batch) that collates to the most token slots (then real
    tokens), of the ``4 * batch_size`` longest generated units packed by the run's option."""
    more = dataclasses.replace(ctx, train=dataclasses.replace(
        ctx.train, batch_size=4 * ctx.train.batch_size))
    units = datasets.Dataset.from_list(_generic_rows(more, tokenizer, length))
    packed, _ = ctx.packing.apply(units, DataStats(rows=len(units), examples=len(units)), ctx)
    items = [packed[i] for i in range(len(packed))]
    sizes = [(b.total_tokens, b.real_tokens)
             for b in (ctx.method.collate([item], tokenizer, ctx) for item in items)]
    return items[max(range(len(items)), key=sizes.__getitem__)]


def new_tokens(method) -> int:
    """Tokens an online method generates per completion."""
    return method.sampling_length()


def worst_case_rollout_tensors(method, real: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The real values of the worst-case generated training batch (every completion runs to its
    full length): the candidates :func:`exact_value_hooks` evaluates the training forward's mask
    decisions on, as it does for collated batches."""
    if "prompt_ids" not in real:
        return {}
    g = method.rows_per_prompt()
    prompt = real["prompt_ids"].repeat_interleave(g, 0)
    pmask = real["prompt_mask"].repeat_interleave(g, 0)
    comp = torch.zeros(prompt.shape[0], new_tokens(method), dtype=torch.long)
    t = join(prompt, pmask, comp, torch.ones_like(comp))
    return {f"rollout_{k}": v for k, v in t.items()}
