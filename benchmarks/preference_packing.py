"""Packed preference training against padded batches: DPO tokens/s and peak memory, side by side.

Every layout trains DPO on memlab's embedded preference pairs (tiny model, CPU) for the same
number of optimizer steps, one fresh ``python -m memlab`` process per run, the layouts of a
round in rotating order so that a slow spell of this shared machine does not fall on one of
them. A run's summary.json gives both numbers: the byte-exact peak of its tracked steps
(``measure.memory_steps=auto``) and tokens/s over its untracked steps (non-padding tokens; a
shared prompt counts once) and pairs/s (the same pairs whatever the layout: the measure that
does not depend on how tokens are counted). Speed is compared only as a ratio to the padded run *of the same
round*; the table gives the median ratio and its range over the rounds.

Targets (issue 17; not tests): ``packing=bfd_split method.share_prompt=true`` at >= 1.6x the
padded run's tokens/s and <= 0.7x its peak.

Usage: ``python benchmarks/preference_packing.py [--rounds 3] [--steps 12] [--max-length 1024]
[--only NAME ...] [--out PATH] [--dry-run]`` (``--dry-run``: every layout's run composed and
validated, nothing run); writes ``benchmarks/results/preference_packing.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
BASELINE = "padded"
TARGET = "bfd_split+share"
TARGET_SPEED, TARGET_PEAK = 1.6, 0.7

LAYOUTS: dict[str, list[str]] = {
    "padded": ["packing=none", "method.padding_free=false", "method.share_prompt=false"],
    "padding_free": ["packing=none", "method.padding_free=true", "method.share_prompt=false"],
    "padding_free+share": ["packing=none", "method.padding_free=true", "method.share_prompt=true"],
    "bfd": ["packing=bfd", "method.padding_free=true", "method.share_prompt=false"],
    "bfd_split": ["packing=bfd_split", "method.padding_free=true", "method.share_prompt=false"],
    "bfd+share": ["packing=bfd", "method.padding_free=true", "method.share_prompt=true"],
    "bfd_split+share": ["packing=bfd_split", "method.padding_free=true",
                        "method.share_prompt=true"],
}


def overrides(name: str, args: argparse.Namespace) -> list[str]:
    return ["method=dpo", *LAYOUTS[name], f"method.max_length={args.max_length}",
            f"train.steps={args.steps}", f"train.batch_size={args.batch_size}",
            "train.progress=false", "train.device=cpu"]


def dry_run(names: list[str], args: argparse.Namespace) -> int:
    """Every layout's run composed and validated, its command printed; nothing run."""
    from _dry_run import check, done, show

    for name in names:
        show("preference_packing", name, ["memlab", *overrides(name, args)])
    return done("preference_packing",
                check("preference_packing", [(n, overrides(n, args)) for n in names]))


def one_run(name: str, args: argparse.Namespace, where: Path) -> dict:
    run_dir = where / name
    cmd = [sys.executable, "-m", "memlab", *overrides(name, args), f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except OSError:
        return {"status": "failed", "error": r.stderr[-2000:], "wall_s": wall}
    if s["status"] != "ok":
        return {"status": s["status"], "error": s.get("error"), "wall_s": wall}
    mem, thr, data = s["memory"], s["throughput"], s["data"]
    return {
        "status": "ok", "wall_s": wall,
        "peak_bytes": mem["peak_bytes"], "by_category": mem["by_category"],
        "tokens_per_s": thr["tokens_per_s"], "tokens_per_s_std": thr["tokens_per_s_std"],
        "timed_steps": thr["timed_steps"], "step_time_s": thr["step_time_s"],
        "pairs_per_s": thr["samples_per_s"],
        "tokens_trained": data.get("tokens_trained"), "rows": data.get("rows"),
        "fill_ratio": data.get("fill_ratio"), "padding_fraction": data.get("padding_fraction"),
        "tokens_dropped": data.get("tokens_dropped"), "units_split": data.get("units_split"),
        "loss_curve": s["train"]["loss_curve"],
    }


def summarise(rounds: list[dict[str, dict]], names: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name in names:
        runs = [rd[name] for rd in rounds if rd.get(name, {}).get("status") == "ok"]
        if not runs:
            out[name] = {"status": rounds[0].get(name, {}).get("status", "not run")}
            continue
        paired = [rd for rd in rounds if rd.get(name, {}).get("status") == "ok"
                  and rd.get(BASELINE, {}).get("status") == "ok"]
        speed = [rd[name]["tokens_per_s"] / rd[BASELINE]["tokens_per_s"] for rd in paired]
        pairs = [rd[name]["pairs_per_s"] / rd[BASELINE]["pairs_per_s"] for rd in paired]
        peaks = {r["peak_bytes"] for r in runs}
        out[name] = {
            "status": "ok",
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "speed_ratio_median": statistics.median(speed) if speed else None,
            "speed_ratio_range": [min(speed), max(speed)] if speed else None,
            "pairs_per_s_median": statistics.median(r["pairs_per_s"] for r in runs),
            "pairs_ratio_median": statistics.median(pairs) if pairs else None,
            "pairs_ratio_range": [min(pairs), max(pairs)] if pairs else None,
            "peak_bytes": max(peaks), "peak_same_every_round": len(peaks) == 1,
            "peak_ratio": max(peaks) / paired[0][BASELINE]["peak_bytes"] if paired else None,
            "activations_bytes": runs[0]["by_category"]["activations"],
            "fill_ratio": runs[0]["fill_ratio"], "padding_fraction": runs[0]["padding_fraction"],
            "tokens_dropped": runs[0]["tokens_dropped"], "rows": runs[0]["rows"],
            "tokens_trained": runs[0]["tokens_trained"],
            "final_loss": runs[0]["loss_curve"][-1],
        }
    return out


def table(summary: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [f"DPO, embedded preference pairs, tiny model, max_length {args.max_length}, batch "
             f"{args.batch_size}, {args.steps} steps, {args.rounds} round(s); x padded = ratio to "
             "the padded run of the same round (median [min-max])",
             "| layout | peak MiB | x padded peak | activations MiB | tokens/s | x padded tokens/s "
             "| pairs/s | x padded pairs/s | padding | fill | tokens dropped | tokens trained "
             "| final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} |" + " |" * 11)
            continue
        rng, prng = r["speed_ratio_range"], r["pairs_ratio_range"]
        fill = "-" if r["fill_ratio"] is None else f"{r['fill_ratio']:.3f}"
        lines.append(
            f"| {name} | {r['peak_bytes'] / MIB:.1f} | {r['peak_ratio']:.2f} | "
            f"{r['activations_bytes'] / MIB:.1f} | {r['tokens_per_s_median']:.0f} | "
            f"{r['speed_ratio_median']:.2f} [{rng[0]:.2f}-{rng[1]:.2f}] | "
            f"{r['pairs_per_s_median']:.2f} | "
            f"{r['pairs_ratio_median']:.2f} [{prng[0]:.2f}-{prng[1]:.2f}] | "
            f"{100 * r['padding_fraction']:.1f}% | {fill} | {r['tokens_dropped']:,} | "
            f"{r['tokens_trained']:,} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def verdict(summary: dict[str, dict]) -> dict:
    t = summary.get(TARGET, {})
    if t.get("status") != "ok":
        return {"met": False, "why": f"{TARGET} did not run"}
    speed_ok = t["speed_ratio_median"] >= TARGET_SPEED
    peak_ok = t["peak_ratio"] <= TARGET_PEAK
    return {"met": speed_ok and peak_ok, "speed_ratio_median": t["speed_ratio_median"],
            "speed_target": TARGET_SPEED, "speed_met": speed_ok,
            "peak_ratio": t["peak_ratio"], "peak_target": TARGET_PEAK, "peak_met": peak_ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--only", nargs="*", default=None, help=f"layouts ({', '.join(LAYOUTS)})")
    ap.add_argument("--out", type=Path,
                    default=REPO / "benchmarks" / "results" / "preference_packing.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="compose and validate every layout's run; run nothing")
    args = ap.parse_args(argv)
    names = [BASELINE] + [n for n in (args.only or LAYOUTS) if n != BASELINE]
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    if args.dry_run:
        return dry_run(names, args)
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="memlab-prefpack-") as tmp:
        for i in range(args.rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            rd: dict[str, dict] = {}
            for name in order:
                rd[name] = one_run(name, args, Path(tmp) / f"round{i}")
                r = rd[name]
                print(f"round {i} {name:>20}: {r['status']}"
                      + (f" {r['tokens_per_s']:.0f} tokens/s, peak "
                         f"{r['peak_bytes'] / MIB:.1f} MiB" if r["status"] == "ok"
                         else f" {r.get('error')}"), flush=True)
            rounds.append(rd)
    summary = summarise(rounds, names)
    print(table(summary, args))
    v = verdict(summary)
    print(f"target ({TARGET} vs {BASELINE}): tokens/s x{v.get('speed_ratio_median', 0):.2f} "
          f"(>= {TARGET_SPEED}), peak x{v.get('peak_ratio', 0):.2f} (<= {TARGET_PEAK}): "
          f"{'met' if v['met'] else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "layouts": {n: LAYOUTS[n] for n in names}, "summary": summary, "target": v,
        "rounds": rounds}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
