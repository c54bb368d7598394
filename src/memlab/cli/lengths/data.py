"""What ``memlab lengths`` measures: the untruncated token lengths of a data config, tokenized
by the method's own ``prepare``."""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from memlab.context import BuildContext

PARTS: tuple[str, ...] = ("prompt", "chosen", "rejected", "completion")
"""Parts of preference-style rows, profiled separately when the prepared dataset has them."""
_NO_LIMIT = re.compile(r"^max_(\w+_)?length$")
"""Method fields set to None to tokenize without truncation (max_length, max_prompt_length...)."""


def untruncated(ctx: BuildContext):
    """``ctx`` whose method has every ``max_*length`` field set to None (no truncation)."""
    method = ctx.method
    if not dataclasses.is_dataclass(method):
        return ctx
    off = {f.name: None for f in dataclasses.fields(method) if _NO_LIMIT.match(f.name)}
    if not off:
        return ctx
    return dataclasses.replace(ctx, method=dataclasses.replace(method, **off))


def _id_columns(ds) -> dict[str, np.ndarray]:
    """Length of every row for each list column of a prepared dataset."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out: dict[str, np.ndarray] = {}
    arrow = ds.with_format("arrow")
    for name in ds.column_names:
        col = arrow[name]
        typ = col.type
        if pa.types.is_list(typ) or pa.types.is_large_list(typ):
            out[name] = np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False),
                                   dtype=np.int64)
    return out


def lengths_of(ds, method: Any = None) -> dict[str, np.ndarray]:
    """Token lengths of a prepared dataset, by name; ``"total"`` is what ``max_length`` bounds.

    * ``input_ids`` (SFT and any one-sequence row): ``{"total": len(input_ids)}``;
    * preference-style rows with ``<part>_input_ids`` (or ``<part>_ids``) columns for the parts
      ``prompt``, ``chosen``, ``rejected``, ``completion``: each part, and ``total`` = prompt +
      the longest of chosen / rejected / completion (the longest sequence the row puts through
      the model; a pair is truncated to fit it). When a prepared dataset also has ``input_ids``
      that column is the total.
    """
    cols = _id_columns(ds)
    parts: dict[str, np.ndarray] = {}
    for part in PARTS:
        for name in (f"{part}_input_ids", f"{part}_ids"):
            if name in cols:
                parts[part] = cols[name]
                break
    if "input_ids" in cols:
        return {**parts, "total": cols["input_ids"]}
    answers = [parts[p] for p in ("chosen", "rejected", "completion") if p in parts]
    if answers:
        total = np.maximum.reduce(answers) if len(answers) > 1 else answers[0]
        if "prompt" in parts:
            total = total + parts["prompt"]
        return {**parts, "total": total}
    raise ValueError(
        f"cannot find token ids in the prepared dataset (columns {sorted(ds.column_names)}); "
        "expected 'input_ids' or '<prompt|chosen|rejected|completion>_input_ids'"
    )


_WORK: tuple[Any, Any, Any] | None = None
"""(ctx, tokenizer, raw data) shared with forked tokenizing workers."""


def _prepare_shard(job: tuple[int, int]) -> dict[str, np.ndarray]:
    index, shards = job
    import datasets

    datasets.disable_progress_bars()
    assert _WORK is not None
    ctx, tokenizer, raw = _WORK
    shard = raw.shard(num_shards=shards, index=index, contiguous=True)
    ds, _ = ctx.method.prepare(shard, tokenizer, ctx)
    return lengths_of(ds, ctx.method)


def tokenize_lengths(ctx: BuildContext, tokenizer, raw, num_proc: int = 1) -> dict[str, np.ndarray]:
    """Lengths of ``raw`` tokenized by ``ctx.method.prepare`` without truncation (row order kept).

    ``num_proc > 1`` splits the rows into contiguous shards prepared in forked processes (Linux);
    the result is identical, only faster.
    """
    global _WORK
    ctx = untruncated(ctx)
    n = len(raw)
    shards = max(1, min(int(num_proc), n // 250))
    if shards > 1 and sys.platform.startswith("linux"):
        import multiprocessing as mp

        _WORK = (ctx, tokenizer, raw)
        try:
            with mp.get_context("fork").Pool(shards) as pool:
                parts = pool.map(_prepare_shard, [(i, shards) for i in range(shards)])
        finally:
            _WORK = None
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    ds, _ = ctx.method.prepare(raw, tokenizer, ctx)
    return lengths_of(ds, ctx.method)

