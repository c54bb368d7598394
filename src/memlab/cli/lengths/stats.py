"""The statistics of ``memlab lengths``: percentiles, truncation, padding under the trainer's own
batching, packing fill, the recommended ``max_length``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from memlab.packing.core import plan as packing_plan

PERCENTILES: tuple[int, ...] = (50, 75, 90, 95, 99)
DEFAULT_MAX_TRUNCATED = 0.01
DEFAULT_EPOCHS = 8
"""Epochs of seeded batching averaged for the padding estimate."""
MIN_CANDIDATE, MAX_CANDIDATE = 128, 16384


def percentile(lengths: np.ndarray, q: float) -> int:
    """Nearest-rank percentile: the smallest length with at least ``q``% of the examples at or
    below it (always a length that occurs)."""
    s = np.sort(np.asarray(lengths, dtype=np.int64))
    rank = max(1, math.ceil(q / 100.0 * s.shape[0]))
    return int(s[rank - 1])


def summarize(lengths: np.ndarray) -> dict[str, Any]:
    """p50/p75/p90/p95/p99 (nearest rank), min, max, mean, count and total tokens."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return {"count": 0, "total_tokens": 0}
    out: dict[str, Any] = {f"p{q}": percentile(arr, q) for q in PERCENTILES}
    out.update(min=int(arr.min()), max=int(arr.max()), mean=float(arr.mean()),
               count=int(arr.size), total_tokens=int(arr.sum()))
    return out


def default_candidates(max_len: int) -> list[int]:
    """Powers of two from 128 to 16384 that are at most twice the longest example (at least 128)."""
    out = [c for c in (2**k for k in range(7, 15)) if c <= 2 * max_len]
    return out or [MIN_CANDIDATE]


def epoch_permutations(n: int, seed: int, epochs: int) -> list[np.ndarray]:
    """The row order of the first ``epochs`` epochs of the trainer's ``BatchStream``."""
    import torch

    perms = []
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perms.append(torch.randperm(n, generator=g).numpy().astype(np.int64))
    return perms


def padded_slots(lengths: np.ndarray, batch_size: int, perm: np.ndarray,
                 multiple: int | None = None) -> int:
    """Token slots of padded batches: consecutive ``batch_size`` rows of ``perm`` (the last
    batch may be shorter), each padded to its longest row rounded up to ``multiple``."""
    n = perm.shape[0]
    if n == 0:
        return 0
    nb = -(-n // batch_size)
    grid = np.zeros(nb * batch_size, dtype=np.int64)
    grid[:n] = lengths[perm]
    widths = grid.reshape(nb, batch_size).max(axis=1)
    if multiple:
        widths = -(-widths // multiple) * multiple
    rows = np.full(nb, batch_size, dtype=np.int64)
    rows[-1] = n - (nb - 1) * batch_size
    return int((widths * rows).sum())


def padding_fraction(lengths: np.ndarray, batch_size: int, perms: Iterable[np.ndarray],
                     multiple: int | None = None) -> float:
    """1 - real tokens / padded slots over all the batches of all ``perms`` (how a run reports
    ``padding_fraction``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    real = slots = 0
    for perm in perms:
        real += int(lengths.sum())
        slots += padded_slots(lengths, batch_size, perm, multiple)
    return 1.0 - real / slots if slots else 0.0


def candidate_rows(lengths: np.ndarray, candidates: Sequence[int], batch_size: int,
                   perms: Sequence[np.ndarray], multiple: int | None = None) -> list[dict]:
    """One dict per candidate ``max_length``: truncation, padded-batch padding, bfd fill."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    n = int(lengths.size)
    rows = []
    for c in candidates:
        cut = np.minimum(lengths, c)
        over = int(total - cut.sum())
        n_over = int((lengths > c).sum())
        row: dict[str, Any] = {
            "max_length": int(c),
            "tokens_truncated": over,
            "tokens_truncated_frac": over / total if total else 0.0,
            "examples_truncated": n_over,
            "examples_truncated_frac": n_over / n if n else 0.0,
            "padding_frac": padding_fraction(cut, batch_size, perms, multiple),
            "packed_fill": None,
            "packed_rows": None,
        }
        if n:
            p = packing_plan(cut, int(c), "bfd")
            row["packed_fill"] = float(p.fill_ratio)
            row["packed_rows"] = int(p.num_rows)
        rows.append(row)
    return rows


def recommend(rows: Sequence[dict], max_truncated: float, batch_size: int,
              max_len: int) -> dict[str, Any]:
    """The smallest candidate truncating at most ``max_truncated`` of the tokens, and why."""
    ok = [r for r in rows if r["tokens_truncated_frac"] <= max_truncated]
    if not ok:
        last = max(rows, key=lambda r: r["max_length"]) if rows else None
        why = (f"no candidate truncates <= {max_truncated:.1%} of the tokens"
               + (f" (max_length={last['max_length']} still cuts "
                  f"{last['tokens_truncated_frac']:.1%})" if last else "")
               + f"; the longest example has {max_len} tokens: try larger --candidates.")
        return {"max_length": None, "reason": why}
    best = min(ok, key=lambda r: r["max_length"])
    smaller = [r for r in rows if r["max_length"] < best["max_length"]]
    why = (f"max_length={best['max_length']} is the smallest candidate that truncates "
           f"<= {max_truncated:.1%} of the tokens (it cuts {best['tokens_truncated_frac']:.2%} "
           f"of the tokens in {best['examples_truncated_frac']:.1%} of the examples")
    if smaller:
        prev = max(smaller, key=lambda r: r["max_length"])
        why += f"; {prev['max_length']} would cut {prev['tokens_truncated_frac']:.1%}"
    why += ")."
    pad = (f"Padded batches of {batch_size} would carry {best['padding_frac']:.0%} padding at "
           "this length")
    if best["packed_fill"] is not None:
        pad += (f"; bfd packing fills its rows to {best['packed_fill']:.0%} "
                f"({1 - best['packed_fill']:.0%} empty).")
    else:
        pad += "; no rows to pack."
    return {
        "max_length": best["max_length"],
        "reason": why,
        "padding": pad,
        "tokens_truncated_frac": best["tokens_truncated_frac"],
        "examples_truncated_frac": best["examples_truncated_frac"],
        "padding_frac": best["padding_frac"],
        "packed_fill": best["packed_fill"],
    }


def profile(lengths: dict[str, np.ndarray] | np.ndarray, *, batch_size: int,
            candidates: Sequence[int] | None = None, max_truncated: float = DEFAULT_MAX_TRUNCATED,
            seed: int = 0, epochs: int = DEFAULT_EPOCHS,
            pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """The whole profile of some lengths (``{"total": ...}`` plus optional parts, or one array)."""
    if not isinstance(lengths, dict):
        lengths = {"total": np.asarray(lengths, dtype=np.int64)}
    total = np.asarray(lengths["total"], dtype=np.int64)
    if total.size == 0:
        raise ValueError("no examples to profile")
    stats = summarize(total)
    cands = sorted({int(c) for c in (candidates or default_candidates(stats["max"]))})
    perms = epoch_permutations(int(total.size), seed, epochs)
    rows = candidate_rows(total, cands, batch_size, perms, pad_to_multiple_of)
    counts, edges = histogram(total)
    return {
        "stats": stats,
        "parts": {k: summarize(v) for k, v in lengths.items() if k != "total"},
        "batch_size": int(batch_size),
        "seed": int(seed),
        "epochs": int(epochs),
        "pad_to_multiple_of": pad_to_multiple_of,
        "max_truncated": float(max_truncated),
        "candidates": rows,
        "packing": {"strategy": "bfd", "available": True, "note": None},
        "recommended": recommend(rows, max_truncated, batch_size, stats["max"]),
        "histogram": {"bin_edges": edges.tolist(), "counts": counts.tolist(), "log_x": True},
    }


def histogram(lengths: np.ndarray, bins: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Counts over log-spaced bins from the shortest to the longest example."""
    lo, hi = max(1, int(lengths.min())), max(1, int(lengths.max()))
    edges = np.geomspace(lo, hi + 1, bins + 1) if hi > lo else np.array([lo - 0.5, lo + 0.5])
    counts, edges = np.histogram(lengths, bins=edges)
    return counts, edges

