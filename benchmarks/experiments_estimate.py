"""Estimate every shipped real-model experiment (``conf/experiment/``) on its target card.

Each experiment's YAML header documents its estimate command (``memlab estimate
experiment=<name> --card <card>``); this script runs exactly that for every experiment that
names a card, through ``memlab.cli.estimate`` in one process (the architecture comes from the
``config.json`` memlab ships; no weights, no GPU), and prints a Markdown table: parameters,
the estimated peak by category (parameters, gradients, optimizer state, activations, other),
the peak, the verdict against the card, the time the estimate took, and the command that trains
the experiment on a machine with the weights (also from the YAML header). It writes
``benchmarks/results/experiments_estimate.json``.

Usage: ``python benchmarks/experiments_estimate.py [--only NAME ...] [--out PATH] [--dry-run]``
(``--dry-run``: every experiment composed and validated, its card parsed, nothing estimated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "conf" / "experiment"
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")


def commands(path: Path) -> dict[str, str | None]:
    """The estimate and train commands (and the card) documented in an experiment's header."""
    text = path.read_text()
    est = re.search(r"^#\s+(memlab estimate experiment=\S+ --card (\S+))\s*$", text, re.M)
    train = re.search(r"^#\s+(memlab experiment=\S+.*?)\s*$", text, re.M)
    return {"estimate": est.group(1) if est else None, "card": est.group(2) if est else None,
            "train": train.group(1) if train else None}


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def run(name: str, card: str) -> dict:
    from memlab.cli.estimate import build_parser, estimate_one, options_from

    args = build_parser().parse_args(["--card", card])
    t0 = time.perf_counter()
    est = estimate_one([f"experiment={name}"], options_from(args))
    est["wall_s"] = time.perf_counter() - t0
    return est


def dry_run(found: list[tuple[str, str]]) -> int:
    """Every experiment with a card composed and validated as ``memlab estimate --card``
    validates it (for a CUDA machine); nothing estimated."""
    from _dry_run import check, done, for_estimate, show

    bad = 0
    for name, card in found:
        show("experiments_estimate", name,
             ["memlab", "estimate", f"experiment={name}", "--card", card])
        bad += check("experiments_estimate", [(name, [f"experiment={name}"])],
                     validator=for_estimate("cuda"))
    return done("experiments_estimate", bad, [] if found else ["no experiment names a card"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="experiment names to run")
    ap.add_argument("--out", type=Path,
                    default=REPO / "benchmarks" / "results" / "experiments_estimate.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="compose and validate every experiment; estimate nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        found = [(path.stem, commands(path)["card"]) for path in sorted(EXPERIMENTS.glob("*.yaml"))]
        return dry_run([(n, c) for n, c in found
                        if c is not None and (not args.only or n in args.only)])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for path in sorted(EXPERIMENTS.glob("*.yaml")):
        name, cmd = path.stem, commands(path)
        if cmd["card"] is None or (args.only and name not in args.only):
            continue
        print(f"[experiments] {name} on {cmd['card']} ...", file=sys.stderr, flush=True)
        est = run(name, cmd["card"])
        row = {"experiment": name, "card": cmd["card"], "estimate_command": cmd["estimate"],
               "train_command": cmd["train"], "status": est.get("status"),
               "error": est.get("error"), "wall_s": est["wall_s"]}
        if est.get("status") == "ok":
            v = est.get("verdict") or {}
            row.update(params=est["model"]["total"], trainable=est["model"]["trainable"],
                       peak_bytes=est["peak_bytes"], by_category=est["by_category"],
                       peak_at=est.get("peak_at"), fits=v.get("fits"), verdict=v.get("text"),
                       needed_bytes=v.get("needed_bytes"), budget_bytes=v.get("budget_bytes"),
                       batch=est.get("batch", {}).get("shapes"),
                       assumptions=est.get("assumptions"))
        rows.append(row)
    head = ("| experiment | card | params | " + " | ".join(CATEGORIES)
            + " | peak (GiB) | verdict | estimate s |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['experiment']} | {r['card']} | {r['status']}: "
                  f"{(r['error'] or '').splitlines()[0][:80]} |")
            continue
        cats = " | ".join(gib(r["by_category"].get(c)) for c in CATEGORIES)
        print(f"| {r['experiment']} | {r['card']} | {r['params'] / 1e9:.2f}B "
              f"({r['trainable'] / 1e6:.1f}M trained) | {cats} | {gib(r['peak_bytes'])} | "
              f"{r['verdict']} | {r['wall_s']:.0f} |")
    print("\nTrain on a machine with the weights:")
    for r in rows:
        print(f"    {r['train_command']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(),
                                                "platform": platform.platform()},
                                    "rows": rows}, indent=2, default=str) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if rows and all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
