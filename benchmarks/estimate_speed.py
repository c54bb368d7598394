"""Benchmark ``memlab estimate``'s own speed at real model sizes, and check that the estimate did
not change: each case's full ``estimate.json`` (less the estimator's timing) is compared with
the one committed under ``benchmarks/results/estimate_before/``: the estimate of every layer
(``--write-before`` runs each case with ``--every-layer``, the reference
:mod:`memlab.estimate.layers` is exact against; the code before the speed work of issue 33
measured every layer too). The JSON is compared without the one assumption the shortcut adds
(``layers: ...``) and the ``every_layer`` option.

Each case runs in a fresh process (``OMP_NUM_THREADS=1``, bytecode caches on: memlab's own
modules are compiled first, as a user's first run or a wheel install leaves them, so that a
``PYTHONDONTWRITEBYTECODE`` shell does not time the compiler): imports, then ``estimate()`` in
process ``--repeats`` times, as ``memlab estimate`` calls it (a deep model's two shallow builds
at once, the shallower in a forked process; ``--serial``: one after the other, as ``memlab
fit``'s estimates run). ``estimate s`` is the first: what ``memlab estimate`` costs a user's
process after its imports (cold caches: torch's fake-tensor dispatch cache fills as it goes;
the target is read here). ``again s`` is the best of the later ones in the same process, the
caches warm (with ``--serial``: what fit's forked workers pay per candidate). CPU seconds
include the forked builds', max RSS is the larger process's. The first one's JSON is
compared (a second FSDP2 estimate in one process differs in its optimizer phase, before and
after issue 33), with the
process's wall time including imports beside it, CPU seconds (user + system: less sensitive than
wall time to a loaded machine) and max RSS. Targets (issue 33, 2 cores): Llama-3.1-8B LoRA at
4,096 tokens <= 15 s, Qwen2.5-0.5B <= 5 s, the shipped GRPO experiment < 60 s, RSS < 1 GiB.

Usage: ``python benchmarks/estimate_speed.py [--cases a,b] [--repeats N]
[--out benchmarks/results/estimate_speed.json] [--write-before] [--dry-run]`` (``--dry-run``:
every case composed and validated, its flags parsed, nothing estimated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE = REPO / "benchmarks" / "results" / "estimate_before"
CARD = ["--card", "rtx4090"]
TINY = ["model.hidden_size=128", "model.num_layers=2", "train.batch_size=2",
        "method.max_length=256", "precision=fp32"]  # (auto depends on the CPU)
CASES: dict[str, tuple[list[str], list[str]]] = {
    # name -> (overrides, estimate flags)
    "qwen2.5-0.5b sft (experiment)": (["experiment=qwen2.5_0.5b_sft"], CARD),
    "llama3.1-8b lora sft 4096 (experiment)": (["experiment=llama3.1_8b_lora_sft"], CARD),
    "qwen2.5-1.5b grpo lora (experiment)": (["experiment=qwen2.5_1.5b_grpo_lora"], CARD),
    "tiny default": (["precision=fp32"], []),
    "tiny packed bfd lora": ([*TINY, "packing=bfd", "peft=lora"], []),
    "tiny dpo padded": ([*TINY, "method=dpo", "method.max_prompt_length=128"], []),
    "tiny fsdp2 x2": ([*TINY, "distributed=fsdp2", "distributed.nproc=2"], []),
}
"""The speed cases (the first three) and the tiny ones that only check the JSON is unchanged."""

ONE = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
from memlab.cli.estimate import build_parser, options_from
from memlab.cli.compose import compose
from memlab.estimate import estimate
import memlab.estimate.fake  # noqa: F401  (what an estimate imports up front)
t1 = time.perf_counter()
overrides, flags, repeats = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
parallel = sys.argv[4] == "1"
opts = options_from(build_parser().parse_args(flags))
runs, first = [], None
for _ in range(repeats):
    t = time.perf_counter()
    cfg, choices = compose(overrides)
    est = estimate(cfg, opts, choices, overrides, parallel_builds=parallel)
    runs.append(time.perf_counter() - t)
    first = first or est  # the CLI's: the first estimate of a fresh process
est = first
u = resource.getrusage(resource.RUSAGE_SELF)
c = resource.getrusage(resource.RUSAGE_CHILDREN)  # (the forked shallow builds)
est.pop("estimator", None)
# the note of memlab.estimate.layers (two shallow builds extrapolated) is the only text the
# shortcut adds: the estimate is compared without it
layers = [n for n in est.get("assumptions") or [] if n.startswith("layers: ")]
est["assumptions"] = [n for n in est.get("assumptions") or [] if not n.startswith("layers: ")]
(est.get("options") or {}).pop("every_layer", None)
print(json.dumps({"import_s": t1 - t0, "runs_s": runs, "process_s": time.perf_counter() - t0,
                  "cpu_s": u.ru_utime + u.ru_stime + c.ru_utime + c.ru_stime,
                  "max_rss_bytes": max(u.ru_maxrss, c.ru_maxrss) * 1024,
                  "layers_extrapolated": bool(layers), "estimate": est}))
"""


def run_case(overrides: list[str], flags: list[str], repeats: int, parallel: bool = True
             ) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    r = subprocess.run([sys.executable, "-c", ONE, json.dumps(overrides), json.dumps(flags),
                        str(repeats), "1" if parallel else "0"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=7200)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def dry_run(names: list[str]) -> int:
    """Every case composed and validated as ``memlab estimate`` validates it (cuda with a
    ``--card``, as ``memlab.estimate.options.device_of``); nothing estimated. (The flags
    themselves are not parsed: memlab estimate's parser imports the estimator, ~5 s.)"""
    from _dry_run import check, done, for_estimate, show

    bad = 0
    for name in names:
        overrides, flags = CASES[name]
        show("estimate_speed", name, ["memlab", "estimate", *overrides, *flags])
        bad += check("estimate_speed", [(name, overrides)],
                     validator=for_estimate("cuda" if "--card" in flags else "cpu"))
    return done("estimate_speed", bad)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path,
                    default=REPO / "benchmarks" / "results" / "estimate_speed.json")
    ap.add_argument("--serial", action="store_true",
                    help="the two shallow builds one after the other in one process (memlab "
                         "estimate runs them at once, the shallower one forked)")
    ap.add_argument("--write-before", action="store_true",
                    help="write each case's estimate.json as the reference (run with the "
                         "code before the change)")
    ap.add_argument("--dry-run", action="store_true",
                    help="compose and validate every case, parse its flags; estimate nothing")
    args = ap.parse_args(argv)
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    if args.dry_run:
        return dry_run(names)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "src" / "memlab")],
                   check=True)  # (the bytecode a user's process finds: module docstring)
    rows = []
    for name in names:
        overrides, flags = CASES[name]
        print(f"[estimate speed] {name} ...", file=sys.stderr, flush=True)
        res = run_case(overrides, flags + (["--every-layer"] if args.write_before else []),
                       args.repeats, parallel=not args.serial)
        row = {"case": name, "overrides": overrides, "flags": flags,
               **{k: v for k, v in res.items() if k != "estimate"}}
        est = res.get("estimate")
        ref = BEFORE / f"{slug(name)}.json"
        if est is not None and args.write_before:
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(json.dumps(est, indent=1, sort_keys=True, default=str) + "\n")
        if est is not None:
            row["status"] = est["status"]
            row["peak_bytes"] = est.get("peak_bytes")
            now = json.dumps(est, indent=1, sort_keys=True, default=str) + "\n"
            row["same_as_before"] = (ref.read_text() == now) if ref.exists() else None
        rows.append(row)
    print(f"{'case':42}{'import s':>9}{'estimate s':>11}{'again s':>9}{'process s':>10}"
          f"{'CPU s':>8}{'max RSS':>10}  same JSON")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:42}  failed: {r['error'][-200:]}")
            continue
        again = f"{min(r['runs_s'][1:]):>9.1f}" if len(r["runs_s"]) > 1 else f"{'-':>9}"
        print(f"{r['case']:42}{r['import_s']:>9.1f}{r['runs_s'][0]:>11.1f}{again}"
              f"{r['process_s']:>10.1f}{r['cpu_s']:>8.1f}{r['max_rss_bytes'] / 2**20:>6.0f} MiB"
              f"  {r['same_as_before']}")
    load = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(),
                                                "platform": platform.platform(),
                                                "loadavg": load},
                                    "when": time.strftime("%Y-%m-%d %H:%M"),
                                    "rows": rows}, indent=2))
    print(f"(load average {load[0]:.1f}; wrote {args.out})", file=sys.stderr)
    return 0 if all(r.get("same_as_before") is not False and "error" not in r
                    for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
