"""``memlab lengths``: the token-length profile of a data config, to choose ``method.max_length``.

Usage::

    memlab lengths                                        # the embedded default
    memlab lengths data=local data.path=chats.jsonl --batch-size 8
    memlab lengths data=hub data.path=trl-lib/Capybara --candidates 1024,2048,4096
    memlab lengths --out reports/lengths --max-truncated 0.005 --no-plot
    memlab lengths -m data=local data.path='glob(corpora/*.jsonl)'   # one profile per job

Options (``--...``) are this command's; the rest is a run's command line: every ``key=value`` is
a Hydra override, ``-m`` sweeps with Hydra's sweeper and Hydra's flags work. The config is
composed over memlab's configs and validated with :func:`memlab.context.validate`; then the
tokenizer and the data are loaded (never a model) and the
rows are tokenized by the method's own ``prepare`` with every ``max_*length`` knob set to None,
so the lengths are exactly what training would see before truncation (chat template, EOS and
all). Preference-style prepared datasets (``prompt_/chosen_/rejected_/completion_`` id columns)
get one profile per part; the truncation/padding analysis uses ``total`` (see
:func:`memlab.cli.lengths.data.lengths_of`).

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
import json
import os
import sys
import time
from pathlib import Path

from memlab.cli.compose import app_argv, positive_int, run_command
from memlab.cli.lengths.data import PARTS, lengths_of, tokenize_lengths, untruncated
from memlab.cli.lengths.output import format_table, plot
from memlab.cli.lengths.stats import (
    DEFAULT_EPOCHS,
    DEFAULT_MAX_TRUNCATED,
    MAX_CANDIDATE,
    MIN_CANDIDATE,
    PERCENTILES,
    candidate_rows,
    default_candidates,
    epoch_permutations,
    histogram,
    padded_slots,
    padding_fraction,
    percentile,
    profile,
    recommend,
    summarize,
)
from memlab.measure.console import printable
from memlab.measure.summary import write_text_atomic

__all__ = ["DEFAULT_EPOCHS", "DEFAULT_MAX_TRUNCATED", "MAX_CANDIDATE", "MIN_CANDIDATE", "PARTS",
           "PERCENTILES", "candidate_rows", "default_candidates", "epoch_permutations",
           "format_table", "histogram", "lengths_of", "main", "padded_slots",
           "padding_fraction", "percentile", "plot", "profile", "recommend", "summarize",
           "tokenize_lengths", "untruncated"]



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
    p.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                   help="rows per padded batch for the padding estimate (default: "
                        "train.batch_size)")
    p.add_argument("--max-truncated", type=_fraction, default=DEFAULT_MAX_TRUNCATED, metavar="F",
                   help="largest fraction of tokens the recommended max_length may cut "
                        f"(default: {DEFAULT_MAX_TRUNCATED})")
    p.add_argument("--epochs", type=positive_int, default=DEFAULT_EPOCHS, metavar="N",
                   help=f"seeded epochs averaged for the padding estimate (default: "
                        f"{DEFAULT_EPOCHS})")
    p.add_argument("--num-proc", type=positive_int, default=min(8, os.cpu_count() or 1),
                   metavar="N", help="processes to tokenize with (default: CPUs, at most 8)")
    p.add_argument("--no-plot", action="store_true", help="skip lengths.png")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``memlab lengths``; 0 on success, 2 for a bad command line, config or data."""
    return run_command(argv, build_parser(), "memlab lengths", _lengths)


def _lengths(hydra_args: list[str], args: argparse.Namespace, rest: list[str]) -> int:
    """The parsed command line: one Hydra job (a sweep with -m) per composed data config."""
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

    from memlab.context import validate
    from memlab.measure.summary import user_choices
    from memlab.registry import ConfigErrors

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

    from memlab.data import chat
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
        rows, _ = ctx.data.convert(raw)
        with chat.rendering(tokenizer, ctx.data):
            lengths = tokenize_lengths(ctx, tokenizer, rows, args.num_proc)
        timings["tokenize_s"] = time.perf_counter() - t1
    except DataError as e:
        print(f"memlab lengths: bad data: {e}", file=sys.stderr)
        return 2

    batch_size = args.batch_size or ctx.train.batch_size
    layout = ctx.method.row_layout(ctx)
    multiple = layout.pad_to_multiple_of
    result = profile(lengths, batch_size=batch_size, candidates=args.candidates,
                     max_truncated=args.max_truncated, seed=ctx.train.seed, epochs=args.epochs,
                     pad_to_multiple_of=multiple)
    notes = []
    if ctx.packing.packs and ctx.packing.keeps_overflow:
        notes.append(f"packing={ctx.packing.name} keeps overflow tokens: nothing is truncated in "
                     "training; max_length is the row capacity there")
    if layout.packs_rows:
        notes.append("this config puts several sequences in a row (padding-free or packed: no "
                     "padding at all); the padding column is what padded batches would carry")
    result = {
        "choices": choices,
        "overrides": overrides,
        "method": ctx.method.name,
        "data": choices.get("data"),
        "configured_max_length": layout.row_length,
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
    write_text_atomic(path, json.dumps(result, indent=2) + "\n")
    written.insert(0, path)
    print(printable(format_table(result), keep_newlines=True))
    print(f"\nwrote {', '.join(str(p) for p in written)} ({timings['total_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
