"""Benchmark sequence packing (``memlab.packing.core``), side by side with TRL where installed.

Lengths: 1,000,000 draws of a lognormal with median 300 tokens and sigma 1.0 (mean ~495,
p99 ~3,100, tail to 16k), rounded and clipped to [1, 16384], fixed seed. Three sections:

1. ``plan``: our planner alone (lengths in, rows out), every strategy, max_length 2048 and 8192;
   best of ``--repeats`` runs.
2. ``trl_same_lengths``: a ``datasets.Dataset`` with one ``input_ids`` column (int32 ids) of
   those lengths (``--trl-n`` first sequences, default all 1M), packed by TRL's
   ``trl.data_utils.pack_dataset`` (its default: BFD within each 1000-row ``map`` batch) and by
   our ``apply`` (whole dataset at once). Ratios: fill ours / TRL; speedup = TRL seconds / ours,
   for our full ``apply`` (apples to apples: both move the tokens) and for ``plan`` alone (not
   apples to apples: lengths only, shown because the planner is what scales).
3. ``realistic``: an SFT-like dataset of ``--apply-n`` rows (default 100k), ``input_ids`` and
   ``completion_mask`` as int64 lists (what ``Dataset.from_dict`` gives for tokenizer output),
   max_length 2048: our ``apply`` vs TRL ``pack_dataset`` with its default 1000-row batches and
   with one global batch (``map_kwargs={"batch_size": None}``, the same global BFD we do; the
   ``identical`` column checks that both produce exactly the same rows).

TRL is optional and never imported by memlab itself. To run the TRL side without touching the
main environment: ``python -m venv --system-site-packages /tmp/trlvenv &&
/tmp/trlvenv/bin/pip install --no-deps trl && /tmp/trlvenv/bin/python benchmarks/packing.py``.

Usage: ``PYTHONPATH=src python benchmarks/packing.py [--out PATH] [--trl-n N] [--apply-n N]``.
Every run is single-threaded-friendly (set ``OMP_NUM_THREADS=1``); single cold runs for the
dataset sections (each side once, after a small warm-up), best-of-N for ``plan``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from memlab.packing import core  # noqa: E402

STRATEGIES = ("bfd", "bfd_split", "wrapped")
MEDIAN, SIGMA, CLIP = 300, 1.0, (1, 16_384)


def heavy_tailed_lengths(n: int, seed: int) -> np.ndarray:
    """Lognormal lengths (median 300, sigma 1.0), rounded, clipped to [1, 16384]."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(np.log(MEDIAN), SIGMA, n)
    return np.clip(np.round(draws), *CLIP).astype(np.int64)


def timed(fn: Callable[[], Any], repeats: int = 1) -> tuple[float, Any]:
    """Best wall time over ``repeats`` calls, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        result = None
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def token_dataset(lengths: np.ndarray, seed: int, dtype: Any, with_mask: bool) -> Any:
    """An in-memory dataset of random token lists built straight from Arrow offsets."""
    import datasets
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    off = pa.array(offsets.astype(np.int32))
    cols = {
        "input_ids": pa.ListArray.from_arrays(off, rng.integers(0, 150_000, offsets[-1], dtype))
    }
    if with_mask:  # prompt (0) then completion (1): the completion is the last 20-80 %
        prompt = (lengths * rng.uniform(0.2, 0.8, lengths.shape[0])).astype(np.int64)
        pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
        mask = (pos >= np.repeat(prompt, lengths)).astype(dtype)
        cols["completion_mask"] = pa.ListArray.from_arrays(off, mask)
    table = datasets.table.InMemoryTable(pa.table(cols))
    return datasets.Dataset(table, fingerprint=f"bench-{seed}-{lengths.shape[0]}-{with_mask}")


def packed_fill(ds: Any, max_length: int) -> tuple[int, float, int]:
    """Rows, fill ratio and token count of a packed dataset (read from Arrow, no Python lists)."""
    import pyarrow.compute as pc

    tokens = pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0
    rows = len(ds)
    return rows, (tokens / (rows * max_length) if rows else 0.0), tokens


def trl_pack() -> Callable[..., Any] | None:
    """TRL's ``pack_dataset`` when trl is importable (benchmark only)."""
    try:
        from trl.data_utils import pack_dataset
    except Exception:  # noqa: BLE001 - any import problem means "no TRL side"
        return None
    return pack_dataset


def section_plan(lengths: np.ndarray, max_lengths: Sequence[int], repeats: int) -> list[dict]:
    out = []
    for max_length in max_lengths:
        for strategy in STRATEGIES:
            secs, p = timed(partial(core.plan, lengths, max_length, strategy), repeats)
            out.append(
                {
                    "max_length": max_length,
                    "strategy": strategy,
                    "seconds": secs,
                    "rows": p.num_rows,
                    "fill_ratio": p.fill_ratio,
                    "tokens_dropped": p.tokens_dropped,
                }
            )
    return out


def section_trl_same_lengths(
    lengths: np.ndarray,
    max_lengths: Sequence[int],
    strategies: Sequence[str],
    pack_dataset: Callable[..., Any],
    seed: int,
) -> list[dict]:
    ds = token_dataset(lengths, seed, np.int32, with_mask=False)
    out = []
    for max_length in max_lengths:
        for strategy in strategies:
            plan_s, p = timed(partial(core.plan, lengths, max_length, strategy), 3)
            ours_s, (packed, stats) = timed(partial(core.apply, ds, max_length, strategy))
            del packed
            trl_s, trl_ds = timed(partial(pack_dataset, ds, max_length, strategy))
            trl_rows, trl_fill, trl_tokens = packed_fill(trl_ds, max_length)
            del trl_ds
            out.append(
                {
                    "max_length": max_length,
                    "strategy": strategy,
                    "sequences": int(lengths.shape[0]),
                    "ours_plan_seconds": plan_s,
                    "ours_apply_seconds": ours_s,
                    "trl_seconds": trl_s,
                    "ours_rows": stats.rows,
                    "trl_rows": trl_rows,
                    "ours_fill": stats.fill_ratio,
                    "trl_fill": trl_fill,
                    "ours_tokens_out": stats.tokens_out,
                    "trl_tokens_out": trl_tokens,
                    "fill_vs_trl": stats.fill_ratio / trl_fill,
                    "speedup_apply_vs_trl": trl_s / ours_s,
                    "speedup_plan_vs_trl": trl_s / plan_s,
                }
            )
            print(_fmt_row(out[-1], TRL_COLS), flush=True)
    return out


def section_realistic(
    lengths: np.ndarray,
    max_length: int,
    pack_dataset: Callable[..., Any] | None,
    seed: int,
) -> list[dict]:
    ds = token_dataset(lengths, seed + 1, np.int64, with_mask=True)
    cols = ("input_ids", "completion_mask")
    out = []
    for strategy in STRATEGIES:
        ours_s, (packed, stats) = timed(partial(core.apply, ds, max_length, strategy, cols))
        rec: dict[str, Any] = {
            "max_length": max_length,
            "strategy": strategy,
            "sequences": int(lengths.shape[0]),
            "tokens_in": stats.tokens_in,
            "ours_apply_seconds": ours_s,
            "ours_rows": stats.rows,
            "ours_fill": stats.fill_ratio,
        }
        if pack_dataset is not None:
            trl_s, trl_ds = timed(partial(pack_dataset, ds, max_length, strategy))
            rec["trl_seconds"] = trl_s
            rec["trl_rows"], rec["trl_fill"], _ = packed_fill(trl_ds, max_length)
            del trl_ds
            glob_s, glob_ds = timed(
                partial(pack_dataset, ds, max_length, strategy, map_kwargs={"batch_size": None})
            )
            rec["trl_global_seconds"] = glob_s
            rec["trl_global_rows"], rec["trl_global_fill"], _ = packed_fill(glob_ds, max_length)
            rec["identical_to_trl_global"] = all(
                packed.data.column(c).equals(glob_ds.data.column(c)) for c in cols
            )
            del glob_ds
            rec["fill_vs_trl"] = stats.fill_ratio / rec["trl_fill"]
            rec["speedup_vs_trl"] = trl_s / ours_s
            rec["speedup_vs_trl_global"] = glob_s / ours_s
        del packed
        out.append(rec)
        print(_fmt_row(rec, REAL_COLS if pack_dataset else REAL_COLS[:5]), flush=True)
    return out


PLAN_COLS = [
    ("max_length", "max_len", "{:d}"),
    ("strategy", "strategy", "{}"),
    ("seconds", "seconds", "{:.3f}"),
    ("rows", "rows", "{:d}"),
    ("fill_ratio", "fill", "{:.5f}"),
    ("tokens_dropped", "dropped", "{:d}"),
]
TRL_COLS = [
    ("max_length", "max_len", "{:d}"),
    ("strategy", "strategy", "{}"),
    ("ours_plan_seconds", "plan_s", "{:.3f}"),
    ("ours_apply_seconds", "apply_s", "{:.2f}"),
    ("trl_seconds", "trl_s", "{:.2f}"),
    ("ours_fill", "fill", "{:.5f}"),
    ("trl_fill", "trl_fill", "{:.5f}"),
    ("fill_vs_trl", "fill/trl", "{:.4f}"),
    ("speedup_apply_vs_trl", "x_apply", "{:.1f}"),
    ("speedup_plan_vs_trl", "x_plan", "{:.0f}"),
]
REAL_COLS = [
    ("max_length", "max_len", "{:d}"),
    ("strategy", "strategy", "{}"),
    ("ours_apply_seconds", "apply_s", "{:.2f}"),
    ("ours_rows", "rows", "{:d}"),
    ("ours_fill", "fill", "{:.5f}"),
    ("trl_seconds", "trl_s", "{:.2f}"),
    ("trl_fill", "trl_fill", "{:.5f}"),
    ("trl_global_seconds", "trl_glob_s", "{:.2f}"),
    ("trl_global_fill", "glob_fill", "{:.5f}"),
    ("identical_to_trl_global", "same_rows", "{}"),
    ("fill_vs_trl", "fill/trl", "{:.4f}"),
    ("speedup_vs_trl", "x_trl", "{:.1f}"),
    ("speedup_vs_trl_global", "x_glob", "{:.1f}"),
]


def _fmt_row(rec: dict, cols: list[tuple[str, str, str]]) -> str:
    return "  ".join(f"{fmt.format(rec[key]):>{max(len(head), 9)}}" for key, head, fmt in cols)


def _header(cols: list[tuple[str, str, str]]) -> str:
    return "  ".join(f"{head:>{max(len(head), 9)}}" for _, head, _ in cols)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="sequences for plan/TRL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3, help="best-of-N for plan timings")
    parser.add_argument("--trl-n", type=int, default=None, help="sequences for TRL (default: n)")
    parser.add_argument("--trl-strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--apply-n", type=int, default=100_000, help="rows of the SFT dataset")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL even if installed")
    parser.add_argument("--out", default="benchmarks/results/packing.json")
    args = parser.parse_args(argv)

    import datasets

    datasets.disable_progress_bars()
    pack_dataset = None if args.no_trl else trl_pack()
    lengths = heavy_tailed_lengths(args.n, args.seed)
    trl_version = None
    if pack_dataset is not None:
        import trl

        trl_version = trl.__version__
    env = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "datasets": datasets.__version__,
        "pyarrow": __import__("pyarrow").__version__,
        "trl": trl_version,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    result: dict[str, Any] = {
        "config": {
            "n": args.n,
            "seed": args.seed,
            "distribution": f"lognormal(median={MEDIAN}, sigma={SIGMA}) clipped to {list(CLIP)}",
            "length_stats": {
                "mean": float(lengths.mean()),
                "median": float(np.median(lengths)),
                "p99": float(np.percentile(lengths, 99)),
                "max": int(lengths.max()),
                "tokens": int(lengths.sum()),
            },
            "max_lengths": args.max_lengths,
            "repeats": args.repeats,
            "trl_n": None,
            "apply_n": args.apply_n,
        },
        "env": env,
    }
    print(f"lengths: {result['config']['length_stats']}  env: {env}")

    # Warm-up (imports, first allocations) on a tiny case for both sides.
    small = heavy_tailed_lengths(2_000, args.seed + 7)
    warm = token_dataset(small, 0, np.int32, with_mask=False)
    core.apply(warm, 2048, "bfd")
    if pack_dataset is not None:
        pack_dataset(warm, 2048, "bfd")

    print(f"\n[1] plan() on {args.n:,} lengths (best of {args.repeats})")
    print(_header(PLAN_COLS))
    result["plan"] = section_plan(lengths, args.max_lengths, args.repeats)
    for rec in result["plan"]:
        print(_fmt_row(rec, PLAN_COLS))

    if pack_dataset is not None:
        trl_n = min(args.trl_n or args.n, args.n)
        result["config"]["trl_n"] = trl_n
        print(
            f"\n[2] same lengths as a dataset ({trl_n:,} rows, input_ids int32): our apply()/plan()"
            " vs TRL pack_dataset (1000-row map batches)"
        )
        print(_header(TRL_COLS))
        result["trl_same_lengths"] = section_trl_same_lengths(
            lengths[:trl_n], args.max_lengths, args.trl_strategies, pack_dataset, args.seed
        )
    else:
        print("\n[2] trl not importable: TRL comparison skipped")

    real_n = min(args.apply_n, args.n)
    print(
        f"\n[3] SFT-like dataset ({real_n:,} rows, input_ids + completion_mask int64),"
        " max_length 2048: our apply() vs TRL pack_dataset (1000-row batches / one global batch)"
    )
    print(_header(REAL_COLS if pack_dataset else REAL_COLS[:5]))
    result["realistic"] = section_realistic(
        heavy_tailed_lengths(real_n, args.seed + 1), 2048, pack_dataset, args.seed
    )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
