"""Benchmark ``memlab estimate``: seconds and real memory (max RSS) to estimate large models.

Issue 6's target: a 1B-parameter model at 2048 tokens estimates in under a minute on 2 CPU
cores. Each case runs ``python -m memlab mode=estimate ...`` in a fresh process (so import time
counts, as a user sees it) with ``OMP_NUM_THREADS=1``; the table shows the process's wall time,
the estimator's own time, its max RSS and the predicted peak. Wall time varies ~2x on shared
machines: read it against the 60 s target, not as a precise number.

Usage: ``python benchmarks/estimate.py [--out benchmarks/results/estimate.json] [--quick]
[--dry-run]`` (``--dry-run``: every case composed and validated, its command printed, nothing
estimated).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LLAMA_1B = ["model.hidden_size=2048", "model.num_layers=16", "model.num_heads=32",
            "model.num_kv_heads=8", "model.intermediate_size=8192", "model.vocab_size=32000"]

CASES = {
    "1.1B sft fp32, 4 x 2048": [*LLAMA_1B, "method.max_length=2048", "train.batch_size=4"],
    "1.1B sft bf16 + lora, bfd 4 x 2048": [*LLAMA_1B, "method.max_length=2048",
                                          "train.batch_size=4", "precision=bf16", "peft=lora",
                                          "packing=bfd"],
    "1.1B dpo bf16, reference copy, 2 x 2048": [*LLAMA_1B, "method=dpo", "precision=bf16",
                                               "method.max_length=2048", "train.batch_size=2"],
    "1.1B grpo bf16, 2 prompts x 4 x (512 + 256)": [*LLAMA_1B, "method=grpo",
                                                    "precision=bf16", "train.batch_size=2",
                                                    "method.max_prompt_length=512",
                                                    "method.max_completion_length=256"],
}


def command(overrides: list[str], out: str) -> list[str]:
    return [sys.executable, "-m", "memlab", "mode=estimate", *overrides, "--out", out]


def dry_run(cases: list[tuple[str, list[str]]]) -> int:
    from _dry_run import check, done, for_estimate, show

    bad = 0
    for name, overrides in cases:
        show("estimate", name, command(overrides, "<tmp>"))
        bad += check("estimate", [(name, overrides)], validator=for_estimate("cpu"))
    return done("estimate", bad)


def run_case(name: str, overrides: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        r = subprocess.run(command(overrides, out), cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=900)
        wall = time.perf_counter() - t0
        path = Path(out) / "estimate.json"
        est = json.loads(path.read_text()) if path.exists() else {}
    row = {"case": name, "overrides": overrides, "returncode": r.returncode,
           "process_s": wall, "status": est.get("status"), "error": est.get("error")}
    if est.get("status") == "ok":
        row.update(estimate_s=est["estimator"]["wall_s"],
                   max_rss_bytes=est["estimator"]["max_rss_bytes"],
                   params=est["model"]["total"], peak_bytes=est["peak_bytes"],
                   by_phase=est["by_phase"], shapes=est["batch"]["shapes"])
    else:
        row["stderr_tail"] = r.stderr[-2000:]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "estimate.json")
    ap.add_argument("--quick", action="store_true", help="the first case only")
    ap.add_argument("--dry-run", action="store_true",
                    help="compose and validate every case, print its command; estimate nothing")
    args = ap.parse_args(argv)
    cases = list(CASES.items())[:1] if args.quick else list(CASES.items())
    if args.dry_run:
        return dry_run(cases)
    rows = []
    for name, overrides in cases:
        print(f"[estimate bench] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_case(name, overrides))
    head = f"{'case':46}{'process s':>10}{'estimate s':>11}{'max RSS':>10}{'peak':>11}  target"
    print(head)
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['case']:46}  {r['status']}: {(r.get('error') or '')[:60]}")
            continue
        print(f"{r['case']:46}{r['process_s']:>10.1f}{r['estimate_s']:>11.1f}"
              f"{r['max_rss_bytes'] / 2**20:>8.0f} MiB{r['peak_bytes'] / 2**30:>7.2f} GiB  "
              + ("< 60 s: yes" if r["process_s"] < 60 else "< 60 s: NO"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(),
                                                "platform": platform.platform()},
                                    "rows": rows}, indent=2))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
