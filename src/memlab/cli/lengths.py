"""``memlab lengths``: the token-length profile of a data config, to choose ``method.max_length``.

Usage::

    memlab lengths                                        # the embedded default
    memlab lengths data=local data.path=chats.jsonl --batch-size 8
    memlab lengths data=hub data.path=trl-lib/Capybara --candidates 1024,2048,4096
    memlab lengths --out reports/lengths --max-truncated 0.005 --no-plot
    memlab lengths -m data=local data.path='glob(corpora/*.jsonl)'   # one profile per job

Options (``--...``) are this command's; the rest is a run's command line: every ``key=value`` is
a Hydra override, ``-m`` sweeps with Hydra's sweeper and Hydra's flags work. The config is
composed over memlab's configs and validated with :func:`memlab.run.validate`; then the tokenizer and the data are loaded (never a model) and the
rows are tokenized by the method's own ``prepare`` with every ``max_*length`` knob set to None,
so the lengths are exactly what training would see before truncation (chat template, EOS and
all). Preference-style prepared datasets (``prompt_/chosen_/rejected_/completion_`` id columns)
get one profile per part; the truncation/padding analysis uses ``total`` (see
:func:`lengths_of`). A method may also define ``sequence_lengths(ds) -> {name: lengths}`` with a
``"total"`` entry to say how its prepared rows are measured.

Reported, and written as ``lengths.json`` and ``lengths.png`` into a Hydra output dir (``--out``,
else ``hydra.run.dir``, else ``outputs/lengths/<date>/<time>/``; a sweep's jobs under
``multirun/lengths/<date>/<time>/<n>/``):

* percentiles (nearest rank: ``pXX`` is the smallest length with at least XX% of the examples
  at or below it), max, mean, count and total tokens;
* for each candidate ``max_length`` (default: the powers of two 128..16384 up to twice the
  longest example): the fraction of tokens and of examples truncated; the padding fraction of
  padded batches of ``--batch-size`` (default ``train.batch_size``) after truncation, over
  ``--epochs`` epochs of the trainer's own seeded shuffle (``BatchStream``: epoch ``e`` is
  ``torch.randperm`` seeded with ``train.seed * 1_000_003 + e``; the last, short batch of an
  epoch is kept; widths rounded up to ``method.pad_to_multiple_of``); and the row fill a
  best-fit-decreasing packing would reach (:func:`memlab.packing.core.plan`, ``"bfd"``);
* the recommended ``max_length``: the smallest candidate that truncates at most
  ``--max-truncated`` (default 0.01) of the tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memlab.cli.compose import app_argv, split_hydra_flags

PERCENTILES: tuple[int, ...] = (50, 75, 90, 95, 99)
DEFAULT_MAX_TRUNCATED = 0.01
DEFAULT_EPOCHS = 8
"""Epochs of seeded batching averaged for the padding estimate."""
MIN_CANDIDATE, MAX_CANDIDATE = 128, 16384
PARTS: tuple[str, ...] = ("prompt", "chosen", "rejected", "completion")
"""Parts of preference-style rows, profiled separately when the prepared dataset has them."""
_NO_LIMIT = re.compile(r"^max_(\w+_)?length$")
"""Method fields set to None to tokenize without truncation (max_length, max_prompt_length...)."""


# --------------------------------------------------------------------------------- config / data


def untruncated(ctx):
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

    * ``method.sequence_lengths(ds)`` when the method defines it (its ``"total"`` is used);
    * ``input_ids`` (SFT and any one-sequence row): ``{"total": len(input_ids)}``;
    * preference-style rows with ``<part>_input_ids`` (or ``<part>_ids``) columns for the parts
      ``prompt``, ``chosen``, ``rejected``, ``completion``: each part, and ``total`` = prompt +
      the longest of chosen / rejected / completion (the longest sequence the row puts through
      the model; a pair is truncated to fit it). When a prepared dataset also has ``input_ids``
      that column is the total.
    """
    if method is not None and callable(getattr(method, "sequence_lengths", None)):
        got = {k: np.asarray(v, dtype=np.int64) for k, v in method.sequence_lengths(ds).items()}
        if "total" not in got:
            raise ValueError("method.sequence_lengths(ds) must return a 'total' entry")
        return got
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


def tokenize_lengths(ctx, tokenizer, raw, num_proc: int = 1) -> dict[str, np.ndarray]:
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


# --------------------------------------------------------------------------------- statistics


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


def _packing_plan():
    try:
        from memlab.packing.core import plan
    except ImportError:
        return None
    return plan


def candidate_rows(lengths: np.ndarray, candidates: Sequence[int], batch_size: int,
                   perms: Sequence[np.ndarray], multiple: int | None = None) -> list[dict]:
    """One dict per candidate ``max_length``: truncation, padded-batch padding, bfd fill."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    n = int(lengths.size)
    plan = _packing_plan()
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
        if plan is not None and n:
            p = plan(cut, int(c), "bfd")
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
        pad += "; bfd packing fill not computed (memlab.packing.core.plan unavailable)."
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
        "packing": {"strategy": "bfd", "available": _packing_plan() is not None,
                    "note": None if _packing_plan() is not None else
                    "memlab.packing.core.plan not available: packed fill skipped"},
        "recommended": recommend(rows, max_truncated, batch_size, stats["max"]),
        "histogram": {"bin_edges": edges.tolist(), "counts": counts.tolist(), "log_x": True},
    }


def histogram(lengths: np.ndarray, bins: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Counts over log-spaced bins from the shortest to the longest example."""
    lo, hi = max(1, int(lengths.min())), max(1, int(lengths.max()))
    edges = np.geomspace(lo, hi + 1, bins + 1) if hi > lo else np.array([lo - 0.5, lo + 0.5])
    counts, edges = np.histogram(lengths, bins=edges)
    return counts, edges


# --------------------------------------------------------------------------------- output


def plot(result: dict[str, Any], lengths: np.ndarray, path: Path, title: str = "") -> Path:
    """Log-x histogram of the lengths, the tokens truncated as a function of max_length (right
    axis) and a vertical line at every candidate (solid: the recommendation)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    h = result["histogram"]
    edges, counts = np.asarray(h["bin_edges"]), np.asarray(h["counts"])
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4C72B0", alpha=0.75,
           edgecolor="white", linewidth=0.4, label="examples")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per example (log scale)")
    ax.set_ylabel("examples")
    ax.grid(alpha=0.25, which="both", axis="x")

    # Fraction of all tokens beyond x, for x over the plotted range.
    s = np.sort(np.asarray(lengths, dtype=np.int64))
    suffix = np.concatenate([np.cumsum(s[::-1])[::-1], [0]])
    cands = [r["max_length"] for r in result["candidates"]]
    lo = max(1.0, min(float(edges[0]), min(cands, default=edges[0]) / 1.2))
    hi = max(float(edges[-1]), max(cands, default=edges[-1])) * 1.5
    xs = np.geomspace(lo, hi, 300)
    k = np.searchsorted(s, xs, side="right")
    lost = (suffix[k] - xs * (s.size - k)) / max(1, s.sum())
    ax2 = ax.twinx()
    ax2.plot(xs, np.clip(lost, 0, 1), color="#C44E52", lw=1.6,
             label="tokens truncated at max_length = x")
    ax2.set_ylabel("fraction of tokens truncated", color="#C44E52")
    ax2.set_ylim(0, 1.02)
    ax.set_xlim(lo, hi)

    rec = result["recommended"]["max_length"]
    for r in result["candidates"]:
        c = r["max_length"]
        best = c == rec
        ax.axvline(c, color="#2ca02c" if best else "#555555", lw=2.0 if best else 0.9,
                   ls="-" if best else "--", alpha=0.9)
        ax.annotate(f"{c}" + (" *" if best else "") + f"\n{r['tokens_truncated_frac']:.1%}",
                    (c, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -4),
                    textcoords="offset points", va="top", ha="left", fontsize=7,
                    color="#2ca02c" if best else "#333333")
    st = result["stats"]
    text = (f"n={st['count']}  p50={st['p50']}  p90={st['p90']}  p99={st['p99']}  "
            f"max={st['max']}  mean={st['mean']:.0f}")
    if rec is not None:
        text += f"\nrecommended max_length={rec} (<= {result['max_truncated']:.1%} tokens cut)"
    ax.set_title((title + "\n" if title else "") + text, fontsize=9)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [hd.get_label() for hd in handles], loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(result: dict[str, Any]) -> str:
    """Percentiles, the candidate table and the recommendation as plain text."""
    keys = [f"p{q}" for q in PERCENTILES] + ["max", "mean", "count", "total_tokens"]
    named = [("total", result["stats"])] + list(result["parts"].items())
    head = ["tokens"] + keys
    body = [[name] + [(f"{st[k]:.1f}" if k == "mean" else str(st[k])) for k in keys]
            for name, st in named]
    lines = _grid(head, body)
    lines.append("")
    b = result["batch_size"]
    head = ["max_length", "tokens_cut", "examples_cut", f"padding@bs{b}", "bfd_fill", "bfd_rows"]
    rec = result["recommended"]["max_length"]
    body = []
    for r in result["candidates"]:
        body.append([f"{r['max_length']}{' *' if r['max_length'] == rec else ''}",
                     _fmt_pct(r["tokens_truncated_frac"]), _fmt_pct(r["examples_truncated_frac"]),
                     _fmt_pct(r["padding_frac"]), _fmt_pct(r["packed_fill"]),
                     "-" if r["packed_rows"] is None else str(r["packed_rows"])])
    lines += _grid(head, body)
    lines.append("")
    if result["packing"]["note"]:
        lines.append(f"note: {result['packing']['note']}")
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    r = result["recommended"]
    lines.append(f"recommended max_length: {r['max_length'] if r['max_length'] else '-'}")
    lines.append(f"  {r['reason']}")
    if r.get("padding"):
        lines.append(f"  {r['padding']}")
    return "\n".join(lines)


def _grid(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(head[i]), *(len(row[i]) for row in body)) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths)),
            *(fmt.format(*row) for row in body)]


# --------------------------------------------------------------------------------- CLI


def _candidates(text: str) -> list[int]:
    try:
        out = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 512,1024,2048, got {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"candidates must be positive integers, got {text!r}")
    return out


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``memlab lengths`` argument parser (Hydra overrides are split off before it)."""
    p = argparse.ArgumentParser(
        prog="memlab lengths",
        description="Token-length profile of a data config, to choose method.max_length. "
                    "key=value arguments are Hydra overrides and -m sweeps, as for a run.",
        allow_abbrev=False,
    )
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where to write lengths.json and lengths.png: hydra.run.dir=DIR "
                        "(hydra.sweep.dir=DIR with -m); default outputs/lengths/<date>/<time>")
    p.add_argument("--candidates", type=_candidates, default=None, metavar="N,N,...",
                   help="max_length values to evaluate (default: powers of two 128..16384 "
                        "up to twice the longest example)")
    p.add_argument("--batch-size", type=_positive, default=None, metavar="N",
                   help="rows per padded batch for the padding estimate (default: "
                        "train.batch_size)")
    p.add_argument("--max-truncated", type=_fraction, default=DEFAULT_MAX_TRUNCATED, metavar="F",
                   help="largest fraction of tokens the recommended max_length may cut "
                        f"(default: {DEFAULT_MAX_TRUNCATED})")
    p.add_argument("--epochs", type=_positive, default=DEFAULT_EPOCHS, metavar="N",
                   help=f"seeded epochs averaged for the padding estimate (default: "
                        f"{DEFAULT_EPOCHS})")
    p.add_argument("--num-proc", type=_positive, default=min(8, os.cpu_count() or 1),
                   metavar="N", help="processes to tokenize with (default: CPUs, at most 8)")
    p.add_argument("--no-plot", action="store_true", help="skip lengths.png")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``memlab lengths``; 0 on success, 2 for a bad command line, config or data."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    hydra_args, rest = split_hydra_flags(argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(rest)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        parser.print_usage(sys.stderr)
        print(f"memlab lengths: unknown option(s): {' '.join(unknown)}", file=sys.stderr)
        return 2
    if not args.no_plot:
        from memlab._guards import missing

        err = missing("matplotlib", "lengths.png")
        if err:
            print(f"memlab lengths: {err} (or pass --no-plot)", file=sys.stderr)
            return 2

    from memlab.cli.app import run_app

    codes: list[int] = []
    try:
        run_app(lambda cfg: codes.append(_job(cfg, args)),
                [*hydra_args, *app_argv(rest, "lengths", args.out)], prog="memlab lengths")
    except SystemExit as e:  # Hydra reports a bad override / config and exits
        if codes or not e.code:
            raise
        return 2
    return max(codes, default=0)


def _job(cfg, args: argparse.Namespace) -> int:
    """One Hydra job: profile the composed data config into the job's output dir."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from memlab.measure.summary import user_choices
    from memlab.registry import ConfigErrors
    from memlab.run import validate

    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    choices = user_choices(hc.runtime.choices)
    try:
        ctx = validate(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), out_dir,
                       choices)
    except ConfigErrors as e:
        print(f"memlab lengths: invalid config:\n{e}", file=sys.stderr)
        return 2
    timings["config_s"] = time.perf_counter() - t0

    from memlab.data.base import DataError

    try:
        tokenizer = ctx.model.load_tokenizer(ctx)
        raw = ctx.data.load(ctx)
        timings["load_s"] = time.perf_counter() - t0 - timings["config_s"]
        if len(raw) == 0:
            print("memlab lengths: the dataset has no rows", file=sys.stderr)
            return 2
        print(f"[memlab lengths] tokenizing {len(raw)} rows of data={choices.get('data', '?')} "
              f"with method={ctx.method.name}'s own prepare (no truncation)...", flush=True)
        t1 = time.perf_counter()
        lengths = tokenize_lengths(ctx, tokenizer, raw, args.num_proc)
        timings["tokenize_s"] = time.perf_counter() - t1
    except DataError as e:
        print(f"memlab lengths: bad data: {e}", file=sys.stderr)
        return 2

    batch_size = args.batch_size or ctx.train.batch_size
    multiple = getattr(ctx.method, "pad_to_multiple_of", None)
    result = profile(lengths, batch_size=batch_size, candidates=args.candidates,
                     max_truncated=args.max_truncated, seed=ctx.train.seed, epochs=args.epochs,
                     pad_to_multiple_of=multiple)
    notes = []
    if ctx.packing.name != "none" and getattr(ctx.packing, "keeps_overflow", False):
        notes.append(f"packing={ctx.packing.name} keeps overflow tokens: nothing is truncated in "
                     "training; max_length is the row capacity there")
    flat = getattr(ctx.method, "flat", None)
    if callable(flat) and flat(ctx):
        notes.append("this config collates padding-free (no padding at all); the padding column "
                     "is what padded batches would carry")
    result = {
        "choices": choices,
        "overrides": overrides,
        "method": ctx.method.name,
        "data": choices.get("data"),
        "configured_max_length": getattr(ctx.method, "max_length", None),
        "notes": notes,
        **result,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if not args.no_plot:
        title = f"data={result['data']} method={result['method']}"
        if overrides:
            title += "  " + " ".join(overrides)
        written.append(plot(result, lengths["total"], out_dir / "lengths.png", title))
    timings["total_s"] = time.perf_counter() - t0
    result["seconds"] = timings
    path = out_dir / "lengths.json"
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    written.insert(0, path)
    print(format_table(result))
    print(f"\nwrote {', '.join(str(p) for p in written)} ({timings['total_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
