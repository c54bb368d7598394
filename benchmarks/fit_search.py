"""Benchmark ``memlab fit``'s search at real size: its time, and that its pruning is exact.

Runs ``memlab fit --estimate-only`` twice on the same command line, the pruned search (what a
user runs) and ``--exhaustive`` (every candidate estimated to its end), each a fresh process
with its wall and CPU time, and compares the two ``fit.json`` files (issue 45, item 1):

- the same predicted order of the candidates the pruned search keeps (so the same winner);
- every candidate both estimated whole: the same estimate (status, peak, need, fits, FLOPs,
  predicted seconds, offloaded bytes, bytes by category); an attention twin's shared estimate
  is its own;
- every candidate the pruned search stopped over the budget: the exhaustive one does not fit,
  and needs at least what the stop reported;
- every pruned candidate: the exhaustive search finds it not fitting, or the candidate that
  pruned it (a dominating one) fits and ranks before it.

``--compare EXHAUSTIVE PRUNED`` compares two existing ``fit.json`` files instead of running
(the exhaustive 0.5B search is ~35-45 minutes on 2 cores). ``--dry-run``: each case's
configuration composed and validated as fit validates it (cuda, ``--card``), nothing run.

Usage: ``python benchmarks/fit_search.py [--cases a,b] [--out results/fit_search.json]
[--compare EXHAUSTIVE_FIT_JSON PRUNED_FIT_JSON] [--dry-run]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CASES: dict[str, tuple[list[str], list[str]]] = {
    # name -> (overrides, fit flags): the cookbook's 0.5B search, with the space issue 45 names
    "qwen2.5-0.5b sft, --allow peft": (["experiment=qwen2.5_0.5b_sft"],
                                       ["--card", "rtx4090", "--allow", "peft"]),
}
KEYS = ("status", "peak_bytes", "needed_bytes", "fits", "flops_per_step", "predicted_s",
        "offloaded_bytes_per_step", "by_category")
"""What an estimate kept by fit is compared by (its seconds and CPU seconds differ)."""


def _estimate_of(record: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """The candidate's estimate, or its twin's where it shared one (``shared_with``)."""
    twin = c["shared_with"]
    return record["candidates"][twin]["estimate"] if twin is not None else c["estimate"]


def _order(record: dict[str, Any]) -> list[str]:
    ranked = [c for c in record["candidates"] if c["predicted_rank"]]
    return [c["label"] for c in sorted(ranked, key=lambda c: c["predicted_rank"])]


def compare(exhaustive: dict[str, Any], pruned: dict[str, Any]) -> dict[str, Any]:
    """What :func:`main` checks of a pruned search against the exhaustive one (module
    docstring): counts, and each problem found (none: the pruning was exact)."""
    ex = {c["label"]: c for c in exhaustive["candidates"]}
    problems: list[str] = []
    seen = {"estimated whole": 0, "shared a twin's": 0, "stopped": 0, "pruned: no_fit": 0,
            "pruned: parameters": 0, "pruned: dominated": 0}
    if set(ex) != {c["label"] for c in pruned["candidates"]}:
        return {"problems": ["the two searches have different candidates"], "checked": seen}
    order_ex = _order(exhaustive)
    rank = {label: k for k, label in enumerate(order_ex)}
    for c in pruned["candidates"]:
        label, e = c["label"], _estimate_of(exhaustive, ex[c["label"]])
        if e.get("status") != "ok":
            problems.append(f"{label}: the exhaustive search has no whole estimate")
            continue
        if c["pruned"]:
            why = c["pruned"]["reason"]
            seen[f"pruned: {why}"] = seen.get(f"pruned: {why}", 0) + 1
            if why in ("no_fit", "parameters"):  # a lower bound of its need is over the budget
                if e["fits"]:
                    problems.append(f"{label}: pruned as not fitting ({why}), but it fits")
                continue
            by = pruned["candidates"][c["pruned"]["by"]]["label"]
            if not _estimate_of(exhaustive, ex[by])["fits"]:
                problems.append(f"{label}: pruned by {by}, which does not fit")
            elif e["fits"] and not rank[by] < rank[label]:
                problems.append(f"{label}: pruned by {by}, which ranks after it")
            continue
        mine = _estimate_of(pruned, c)
        if mine.get("status") == "over_budget":
            seen["stopped"] += 1
            if e["fits"] or mine["needed_at_least_bytes"] > e["needed_bytes"]:
                problems.append(f"{label}: stopped over the budget, but the exhaustive search "
                                f"needs {e['needed_bytes']} B (fits: {e['fits']})")
            continue
        seen["shared a twin's" if c["shared_with"] is not None else "estimated whole"] += 1
        problems += [f"{label}: {k} {mine.get(k)!r} != {e.get(k)!r}" for k in KEYS
                     if mine.get(k) != e.get(k)]
    kept = {c["label"] for c in pruned["candidates"] if not c["pruned"]}
    order_pr = _order(pruned)
    if order_pr != [label for label in order_ex if label in kept]:
        problems.append("the predicted order of the kept candidates differs")
    return {"candidates": len(ex), "fitting_exhaustive": len(order_ex),
            "fitting_pruned": len(order_pr),
            "winner": order_pr[0] if order_pr else None,
            "winner_same": bool(order_pr and order_ex and order_pr[0] == order_ex[0]),
            "checked": seen, "problems": problems,
            "search_pruned": pruned["search"], "search_exhaustive": {
                k: exhaustive["search"].get(k) for k in ("estimate_s", "estimate_cpu_s")}}


def run_fit(overrides: list[str], flags: list[str], out: Path, exhaustive: bool
            ) -> dict[str, Any]:
    """``memlab fit --estimate-only`` in a fresh process: its wall and CPU seconds and record."""
    argv = [sys.executable, "-m", "memlab", "fit", *flags, "--estimate-only", "--out", str(out),
            *(["--exhaustive"] if exhaustive else []), *overrides]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        return {"error": r.stderr[-3000:], "exit": r.returncode}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "record": json.loads((out / "fit.json").read_text())}


def dry_run(names: list[str]) -> int:
    """Each case's configuration composed and validated as fit's estimates validate it (cuda,
    ``--card``); nothing run."""
    from _dry_run import check, done, for_estimate, show

    bad = 0
    for name in names:
        overrides, flags = CASES[name]
        for extra in ([], ["--exhaustive"]):
            show("fit_search", name, ["memlab", "fit", *flags, "--estimate-only", *extra,
                                      *overrides])
        bad += check("fit_search", [(name, overrides)], validator=for_estimate("cuda"))
    return done("fit_search", bad)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" /
                    "fit_search.json")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("EXHAUSTIVE", "PRUNED"),
                    help="compare two fit.json files instead of running the searches")
    ap.add_argument("--dry-run", action="store_true",
                    help="compose and validate each case, run nothing")
    args = ap.parse_args(argv)
    names = list(CASES) if args.cases is None else args.cases.split(",")
    if args.dry_run:
        return dry_run(names)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                           "platform": platform.platform()}, "cases": {}}
    if args.compare:
        ex, pr = (json.loads(p.read_text()) for p in args.compare)
        results["cases"]["compared"] = {
            "files": [str(p) for p in args.compare], "exhaustive_wall_s": ex.get("wall_s"),
            "pruned_wall_s": pr.get("wall_s"), **compare(ex, pr)}
    else:
        import tempfile

        for name in names:
            overrides, flags = CASES[name]
            with tempfile.TemporaryDirectory() as tmp:
                runs = {kind: run_fit(overrides, flags, Path(tmp) / kind, kind == "exhaustive")
                        for kind in ("pruned", "exhaustive")}
            if any("error" in r for r in runs.values()):
                results["cases"][name] = {k: r.get("error") for k, r in runs.items()}
                continue
            results["cases"][name] = {
                "command": ["memlab", "fit", *flags, "--estimate-only", *overrides],
                **{f"{k}_wall_s": r["wall_s"] for k, r in runs.items()},
                **{f"{k}_cpu_s": r["cpu_s"] for k, r in runs.items()},
                **compare(runs["exhaustive"]["record"], runs["pruned"]["record"])}
    bad = 0
    print(f"{'case':36} {'pruned s':>9} {'exhaustive s':>13} {'fitting':>8} problems")
    for name, r in results["cases"].items():
        n = len(r.get("problems", [])) if "problems" in r else 1
        bad += n
        print(f"{name[:36]:36} {r.get('pruned_wall_s')!s:>9} {r.get('exhaustive_wall_s')!s:>13} "
              f"{r.get('fitting_pruned')!s:>8} {n}")
        for p in r.get("problems", [])[:10]:
            print(f"    {p}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
