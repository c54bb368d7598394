"""``memlab data``: look at the data a run trains on.

Usage::

    memlab data show                                    # the embedded default, 3 rows
    memlab data show data=local data.path=chats.jsonl --rows 5
    memlab data show method=dpo data=local data.path=pairs.jsonl packing=bfd --no-color
    memlab data show data=local data.path=chats.jsonl --json > rows.json

``show`` prints rows as the run sees them, after the method's preparation, truncation and
packing: the first rows of the first micro-batches the trainer receives (the run's own seeded
shuffle), each cut into its documents, with the tokens that carry a loss marked (in colour on a
terminal, else between ``[[`` and ``]]``), the token counts, and what happened to the data:
rows converted on load (ShareGPT, Alpaca, renamed columns), rendered with memlab's training
template, skipped as unsplittable, truncated (each document names its file and line and the
tokens it had before truncation). ``key=value`` arguments are Hydra overrides, as for a run;
nothing is trained and no model is loaded (:mod:`memlab.cli.data.show`).
"""

from __future__ import annotations

import argparse
import json
import sys

from memlab.cli.compose import positive_int, run_command


def build_parser() -> argparse.ArgumentParser:
    """The ``memlab data`` argument parser (Hydra overrides are split off before it)."""
    p = argparse.ArgumentParser(
        prog="memlab data", description="Look at the data a run trains on.", allow_abbrev=False)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    show = sub.add_parser(
        "show", allow_abbrev=False,
        help="rows as the run sees them: prepared, truncated, packed, loss tokens marked",
        description="Print the first rows of the first micro-batches a run's trainer receives "
                    "(after the method's preparation, truncation and packing), the tokens that "
                    "carry a loss marked, with token counts and where each document comes from. "
                    "key=value arguments are Hydra overrides, as for a run.")
    show.add_argument("--rows", type=positive_int, default=3, metavar="N",
                      help="rows to show (default: 3)")
    show.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                      help="mark loss tokens in colour (auto: on a terminal) or between [[ and "
                           "]] (default: auto)")
    show.add_argument("--no-color", dest="color", action="store_const", const="never",
                      help="the same as --color never")
    show.add_argument("--max-chars", type=int, default=4000, metavar="N",
                      help="characters shown per document, 0 for all (default: 4000)")
    show.add_argument("--json", action="store_true",
                      help="print the rows as JSON (token ids, documents, marked positions)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``memlab data``; 0 on success, 2 for a bad command line, config or data."""
    return run_command(argv, build_parser(), "memlab data", _data)


def _data(hydra_args: list[str], args: argparse.Namespace, overrides: list[str]) -> int:
    """The parsed command line: ``show`` is the one subcommand."""
    odd = hydra_args + [a for a in overrides if "=" not in a]
    if odd:
        print(f"memlab data: {' '.join(odd)}: expected key=value overrides (Hydra's flags and "
              "sweeps are for runs)", file=sys.stderr)
        return 2
    return run_show(args, overrides)


def run_show(args: argparse.Namespace, overrides: list[str]) -> int:
    """``memlab data show``: compose, validate, inspect, print."""
    from memlab.cli.compose import compose
    from memlab.cli.data.show import as_dict, format_report, inspect
    from memlab.context import validate
    from memlab.data.base import DataError
    from memlab.registry import ConfigErrors

    try:
        cfg, choices = compose(overrides)
    except Exception as e:  # noqa: BLE001 - Hydra's errors for a bad override
        print(f"memlab data show: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        ctx = validate(cfg, ".", choices)
    except ConfigErrors as e:
        print(f"memlab data show: invalid config:\n{e}", file=sys.stderr)
        return 2
    try:
        tokenizer = ctx.model.load_tokenizer(ctx)
        report = inspect(ctx, tokenizer, args.rows)
    except DataError as e:
        print(f"memlab data show: bad data: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_dict(report), indent=1))
        return 0
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print(format_report(report, tokenizer, color, args.max_chars or None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
