"""Benchmark sequence packing (``memlab.packing.core``), side by side with TRL's ``pack_dataset``.

The case (issue 20): 1,000,000 lengths drawn from a lognormal with median 300 and sigma 1.0,
rounded and clipped to [8, 16000], fixed seed (~495M tokens; mean ~495, p99 ~3,100); a
``datasets.Dataset`` with one ``input_ids`` column of int32 random ids of those lengths, in
memory, one Arrow chunk. Sections:

1. ``plan``: our planner alone (lengths in, rows out), every strategy, max_length 2048 and
   8192; best of ``--plan-repeats``.
2. ``dataset``: the same dataset in and out. For each max_length and strategy, ``--repeats``
   rounds; in each round our ``core.apply`` (plan + apply) and TRL's
   ``trl.data_utils.pack_dataset`` (its default: BFD within each 1000-row ``map`` batch) run one
   after the other, the order alternating between rounds. Reported: medians, the ratio of the
   medians (TRL / ours) and the per-round ratios (their spread), rows (ours / TRL / lower bound
   ``ceil(tokens / max_length)``), fill, and peak memory. ``lean`` is our ``apply`` with
   ``position_ids=False`` (the same columns as TRL's output: no position ids, which a collator
   can derive from ``seq_lengths``), timed in the same rounds.
3. ``realistic``: an SFT-like dataset of ``--apply-n`` rows (default 100k), ``input_ids`` and
   ``completion_mask`` as int64 lists, max_length 2048: our ``apply`` vs TRL with its default
   1000-row batches and with one global batch (``map_kwargs={"batch_size": None}``, the same
   global BFD we do; ``identical`` checks that both give exactly the same rows).
4. ``sharded``: our ``apply`` writing its output shard by shard to an Arrow file
   (``output_path``, default shard size) vs all at once in memory, 1M case, max_length 2048.

Memory: *peak RSS increase* of the process during the call: the kernel's high-water mark
(``VmHWM``, reset before the call by writing 5 to ``/proc/self/clear_refs``) minus the RSS just
before it. It counts Arrow's and numpy's allocations alike (tracemalloc would miss Arrow's).
``output`` is the packed table's Arrow size (``Table.nbytes``); for ``wrapped`` our ``input_ids``
share the input's buffer, so the memory we add is less than that.

This machine is a small VM whose freed memory is handed back to the host within about a
second; touching it again then costs seconds per GiB, more than the packing itself. So each
timed call is preceded (untimed, on both sides alike) by touching ``--prewarm-gb`` GiB and
freeing it, which makes the timings those of an ordinary machine; ``--prewarm-gb 0`` disables
it. Speed is compared only as ratios of runs made side by side in one invocation.

TRL is optional and never imported by memlab. To run the TRL side without touching the main
environment: ``.venv-trl``, a venv over ``.venv`` with TRL added (benchmarks/README.md gives
the commands: a ``.pth`` line for ``.venv``'s packages, ``--system-site-packages`` does not reach
them), then ``OMP_NUM_THREADS=1 .venv-trl/bin/python benchmarks/packing.py``. ``--dry-run``: every
section on 2,000 rows, once, without TRL (seconds; the JSON to a temp file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from memlab.packing import core  # noqa: E402

STRATEGIES = ("bfd", "bfd_split", "wrapped")
MEDIAN, SIGMA, CLIP = 300, 1.0, (8, 16_000)
GIB = 1024**3
COLLECT = True
"""Whether a measured call starts with a full garbage collection (not in a dry run: the
collections of a large process, such as a test session's, would be most of its time)."""


def heavy_tailed_lengths(n: int, seed: int) -> np.ndarray:
    """Lognormal lengths (median 300, sigma 1.0), rounded, clipped to [8, 16000]."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(np.log(MEDIAN), SIGMA, n)
    return np.clip(np.round(draws), *CLIP).astype(np.int64)


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


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def prewarm(gib: float) -> None:
    """Touch ``gib`` GiB (one write per 4 KiB page) and free it (see the module docstring)."""
    if gib <= 0:
        return
    block = np.empty(int(gib * GIB) // 4, dtype=np.int32)
    block[::1024] = 1
    del block


def measured(fn: Callable[[], Any], prewarm_gib: float) -> tuple[float, int | None, Any]:
    """``(seconds, peak RSS increase in bytes or None, result)`` of one call."""
    import pyarrow as pa

    if COLLECT:
        gc.collect()
    pa.default_memory_pool().release_unused()
    prewarm(prewarm_gib)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _status_kib("VmRSS")
    except OSError:
        before = None
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    grew = (peak - before) * 1024 if before is not None and peak is not None else None
    return seconds, grew, result


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best wall time over ``repeats`` calls, and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        result = None
        if COLLECT:
            gc.collect()
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def packed_summary(ds: Any, max_length: int) -> tuple[int, float, int, int]:
    """Rows, fill ratio, token count and Arrow bytes of a packed dataset (no Python lists)."""
    import pyarrow.compute as pc

    tokens = pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py() or 0
    rows = len(ds)
    return rows, (tokens / (rows * max_length) if rows else 0.0), tokens, ds.data.table.nbytes


def trl_pack() -> Callable[..., Any] | None:
    """TRL's ``pack_dataset`` when trl is importable (benchmark only)."""
    try:
        from trl.data_utils import pack_dataset
    except Exception:  # noqa: BLE001 - any import problem means "no TRL side"
        return None
    return pack_dataset


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def section_plan(lengths: np.ndarray, max_lengths: Sequence[int], repeats: int) -> list[dict]:
    out = []
    for max_length in max_lengths:
        for strategy in STRATEGIES:
            secs, p = best_of(partial(core.plan, lengths, max_length, strategy), repeats)
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


def section_dataset(
    lengths: np.ndarray,
    max_lengths: Sequence[int],
    strategies: Sequence[str],
    pack_dataset: Callable[..., Any] | None,
    repeats: int,
    prewarm_gib: float,
    seed: int,
) -> list[dict]:
    ds = token_dataset(lengths, seed, np.int32, with_mask=False)
    out = []
    for max_length in max_lengths:
        for strategy in strategies:
            plan_s, p = best_of(partial(core.plan, lengths, max_length, strategy), 3)
            runs: dict[str, list[tuple[float, int | None]]] = {"ours": [], "lean": [], "trl": []}
            summary: dict[str, Any] = {}
            sides = ["ours", "lean", "trl"] if pack_dataset is not None else ["ours", "lean"]
            for rnd in range(repeats):
                for side in sides if rnd % 2 == 0 else sides[::-1]:
                    if side == "trl":
                        fn = partial(pack_dataset, ds, max_length, strategy)
                    else:
                        fn = partial(
                            core.apply, ds, max_length, strategy, position_ids=side == "ours"
                        )
                    secs, mem, res = measured(fn, prewarm_gib)
                    runs[side].append((secs, mem))
                    packed = res if side == "trl" else res[0]
                    summary[side] = packed_summary(packed, max_length)
                    del packed, res
            ours, lean, trl = runs["ours"], runs["lean"], runs["trl"]
            rows, fill, tokens, nbytes = summary["ours"]
            rec: dict[str, Any] = {
                "max_length": max_length,
                "strategy": strategy,
                "sequences": int(lengths.shape[0]),
                "tokens_in": int(lengths.sum()),
                "tokens_out": tokens,
                "ours_plan_seconds": plan_s,
                "ours_apply_seconds": statistics.median(s for s, _ in ours),
                "ours_apply_runs": [s for s, _ in ours],
                "ours_rows": rows,
                "rows_lower_bound": -(-tokens // max_length),
                "ours_fill": fill,
                "ours_output_bytes": nbytes,
                "ours_peak_rss_bytes": _max_or_none(m for _, m in ours),
                "lean_apply_seconds": statistics.median(s for s, _ in lean),
                "lean_apply_runs": [s for s, _ in lean],
                "lean_output_bytes": summary["lean"][3],
                "lean_peak_rss_bytes": _max_or_none(m for _, m in lean),
            }
            assert p.num_rows == rows == summary["lean"][0]
            rec["ours_peak_over_output"] = _ratio(rec["ours_peak_rss_bytes"], nbytes)
            if trl:
                t_rows, t_fill, t_tokens, t_nbytes = summary["trl"]
                trl_med = statistics.median(s for s, _ in trl)
                rec.update(
                    {
                        "trl_seconds": trl_med,
                        "trl_runs": [s for s, _ in trl],
                        "trl_rows": t_rows,
                        "trl_fill": t_fill,
                        "trl_tokens_out": t_tokens,
                        "trl_output_bytes": t_nbytes,
                        "trl_peak_rss_bytes": _max_or_none(m for _, m in trl),
                        "ratio": trl_med / rec["ours_apply_seconds"],
                        "ratio_runs": [t / o for (t, _), (o, _) in zip(trl, ours)],
                        "lean_ratio": trl_med / rec["lean_apply_seconds"],
                        "lean_ratio_runs": [t / o for (t, _), (o, _) in zip(trl, lean)],
                    }
                )
                rec["ratio_min"], rec["ratio_max"] = min(rec["ratio_runs"]), max(rec["ratio_runs"])
                rec["lean_ratio_min"] = min(rec["lean_ratio_runs"])
                rec["lean_ratio_max"] = max(rec["lean_ratio_runs"])
            out.append(rec)
            print(_fmt_row(rec, DATA_COLS), flush=True)
    return out


def section_realistic(
    lengths: np.ndarray,
    max_length: int,
    pack_dataset: Callable[..., Any] | None,
    prewarm_gib: float,
    seed: int,
) -> list[dict]:
    ds = token_dataset(lengths, seed + 1, np.int64, with_mask=True)
    cols = ("input_ids", "completion_mask")
    out = []
    for strategy in STRATEGIES:
        ours_s, _, (packed, stats) = measured(
            partial(core.apply, ds, max_length, strategy, cols), prewarm_gib
        )
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
            trl_s, _, trl_ds = measured(
                partial(pack_dataset, ds, max_length, strategy), prewarm_gib
            )
            rec["trl_seconds"] = trl_s
            rec["trl_rows"], rec["trl_fill"], _, _ = packed_summary(trl_ds, max_length)
            del trl_ds
            glob_s, _, glob_ds = measured(
                partial(pack_dataset, ds, max_length, strategy, map_kwargs={"batch_size": None}),
                prewarm_gib,
            )
            rec["trl_global_seconds"] = glob_s
            rec["trl_global_rows"], rec["trl_global_fill"], _, _ = packed_summary(
                glob_ds, max_length
            )
            rec["identical_to_trl_global"] = all(
                packed.data.column(c).equals(glob_ds.data.column(c)) for c in cols
            )
            del glob_ds
            rec["speedup_vs_trl"] = trl_s / ours_s
            rec["speedup_vs_trl_global"] = glob_s / ours_s
        del packed
        out.append(rec)
        print(_fmt_row(rec, REAL_COLS if pack_dataset else REAL_COLS[:5]), flush=True)
    return out


def section_sharded(
    lengths: np.ndarray, max_length: int, prewarm_gib: float, seed: int
) -> list[dict]:
    ds = token_dataset(lengths, seed, np.int32, with_mask=False)
    out = []
    with tempfile.TemporaryDirectory(prefix="memlab-packing-bench-") as tmp:
        for strategy in STRATEGIES:
            mem_s, mem_peak, (packed, _) = measured(
                partial(core.apply, ds, max_length, strategy), prewarm_gib
            )
            one_shot_bytes = packed.data.table.nbytes
            del packed
            path = Path(tmp) / f"{strategy}.arrow"
            disk_s, disk_peak, (on_disk, _) = measured(
                partial(core.apply, ds, max_length, strategy, output_path=path), prewarm_gib
            )
            rec = {
                "max_length": max_length,
                "strategy": strategy,
                "shard_rows": core.DEFAULT_SHARD_TOKENS // max_length,
                "shards": on_disk.data.column("input_ids").num_chunks,
                "in_memory_seconds": mem_s,
                "in_memory_peak_rss_bytes": mem_peak,
                "to_disk_seconds": disk_s,
                "to_disk_peak_rss_bytes": disk_peak,
                "output_bytes": one_shot_bytes,
                "file_bytes": path.stat().st_size,
            }
            del on_disk
            out.append(rec)
            print(_fmt_row(rec, SHARD_COLS), flush=True)
    return out


def _max_or_none(values: Any) -> int | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


PLAN_COLS = [
    ("max_length", "max_len", "{:d}"),
    ("strategy", "strategy", "{}"),
    ("seconds", "seconds", "{:.3f}"),
    ("rows", "rows", "{:d}"),
    ("fill_ratio", "fill", "{:.5f}"),
    ("tokens_dropped", "dropped", "{:d}"),
]
DATA_COLS = [
    ("max_length", "max_len", "{:d}"),
    ("strategy", "strategy", "{}"),
    ("ours_plan_seconds", "plan_s", "{:.3f}"),
    ("ours_apply_seconds", "apply_s", "{:.2f}"),
    ("trl_seconds", "trl_s", "{:.2f}"),
    ("ours_rows", "rows", "{:d}"),
    ("ours_fill", "fill", "{:.5f}"),
    ("trl_rows", "trl_rows", "{:d}"),
    ("rows_lower_bound", "bound", "{:d}"),
    ("ratio", "trl/ours", "{:.1f}"),
    ("ratio_min", "min", "{:.1f}"),
    ("ratio_max", "max", "{:.1f}"),
    ("lean_apply_seconds", "lean_s", "{:.2f}"),
    ("lean_ratio", "trl/lean", "{:.1f}"),
    ("lean_ratio_min", "min", "{:.1f}"),
    ("lean_ratio_max", "max", "{:.1f}"),
    ("ours_peak_rss_bytes", "peak_GiB", _gib),
    ("ours_output_bytes", "out_GiB", _gib),
    ("lean_peak_rss_bytes", "lean_peak", _gib),
    ("trl_peak_rss_bytes", "trl_peak", _gib),
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
    ("speedup_vs_trl", "x_trl", "{:.1f}"),
    ("speedup_vs_trl_global", "x_glob", "{:.1f}"),
]
SHARD_COLS = [
    ("max_length", "max_len", "{:d}"),
    ("strategy", "strategy", "{}"),
    ("shards", "shards", "{:d}"),
    ("in_memory_seconds", "mem_s", "{:.2f}"),
    ("in_memory_peak_rss_bytes", "mem_peak", _gib),
    ("to_disk_seconds", "disk_s", "{:.2f}"),
    ("to_disk_peak_rss_bytes", "disk_peak", _gib),
    ("output_bytes", "out_GiB", _gib),
]


def _fmt_row(rec: dict, cols: list[tuple[str, str, Any]]) -> str:
    def cell(key: str, fmt: Any) -> str:
        val = rec.get(key)
        if callable(fmt):
            return fmt(val)
        return "-" if val is None else fmt.format(val)

    return "  ".join(f"{cell(key, fmt):>{max(len(head), 8)}}" for key, head, fmt in cols)


def _header(cols: list[tuple[str, str, Any]]) -> str:
    return "  ".join(f"{head:>{max(len(head), 8)}}" for _, head, _ in cols)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="sequences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--plan-repeats", type=int, default=3, help="best-of-N for plan()")
    parser.add_argument("--repeats", type=int, default=3, help="side-by-side rounds")
    parser.add_argument("--apply-n", type=int, default=100_000, help="rows of the SFT dataset")
    parser.add_argument("--prewarm-gb", type=float, default=6.0)
    parser.add_argument(
        "--sections", nargs="+", default=["plan", "dataset", "realistic", "sharded"]
    )
    parser.add_argument("--no-trl", action="store_true", help="skip TRL even if installed")
    parser.add_argument("--out", default="benchmarks/results/packing.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="every section on 2,000 rows, one round, no TRL, no prewarm; "
                        "the JSON to a temp file")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    if args.dry_run:
        from _dry_run import TRL_MISSING, trl_importable

        if not args.no_trl and not trl_importable():
            print(f"  [packing] {TRL_MISSING}")
        args.n, args.apply_n, args.plan_repeats, args.repeats = 2_000, 500, 1, 1
        args.prewarm_gb, args.no_trl = 0.0, True
        global COLLECT
        COLLECT = False
        args.out = str(Path(tempfile.gettempdir()) / "memlab-packing-dry-run.json")

    import datasets
    import pyarrow as pa

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
        "pyarrow": pa.__version__,
        "trl": trl_version,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": os.getloadavg(),
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
            "plan_repeats": args.plan_repeats,
            "repeats": args.repeats,
            "apply_n": args.apply_n,
            "prewarm_gib": args.prewarm_gb,
            "memory": "peak RSS increase during the call (VmHWM after clear_refs minus VmRSS)",
        },
        "env": env,
    }
    print(f"lengths: {result['config']['length_stats']}  env: {env}")

    # Warm-up (imports, first allocations) on a tiny case for both sides.
    warm = token_dataset(heavy_tailed_lengths(200 if args.dry_run else 2_000, args.seed + 7), 0,
                         np.int32, False)
    for strategy in STRATEGIES:
        core.apply(warm, 2048, strategy)
        if pack_dataset is not None:
            pack_dataset(warm, 2048, strategy)

    if "plan" in args.sections:
        print(f"\n[1] plan() on {args.n:,} lengths (best of {args.plan_repeats})")
        print(_header(PLAN_COLS))
        result["plan"] = section_plan(lengths, args.max_lengths, args.plan_repeats)
        for rec in result["plan"]:
            print(_fmt_row(rec, PLAN_COLS))

    if "dataset" in args.sections:
        print(
            f"\n[2] {args.n:,} rows (input_ids int32) in and out: core.apply (plan + apply) vs TRL"
            f" pack_dataset, {args.repeats} side-by-side rounds (medians; trl/ours = ratio of"
            " medians, min/max over rounds; peak = RSS increase)"
            + ("" if pack_dataset else " -- trl not importable: ours only")
        )
        print(_header(DATA_COLS))
        result["dataset"] = section_dataset(
            lengths,
            args.max_lengths,
            args.strategies,
            pack_dataset,
            args.repeats,
            args.prewarm_gb,
            args.seed,
        )

    if "realistic" in args.sections:
        real_n = min(args.apply_n, args.n)
        print(
            f"\n[3] SFT-like dataset ({real_n:,} rows, input_ids + completion_mask int64),"
            " max_length 2048: our apply() vs TRL (1000-row batches / one global batch)"
        )
        print(_header(REAL_COLS if pack_dataset else REAL_COLS[:5]))
        result["realistic"] = section_realistic(
            heavy_tailed_lengths(real_n, args.seed + 1),
            2048,
            pack_dataset,
            args.prewarm_gb,
            args.seed,
        )

    if "sharded" in args.sections:
        print(
            f"\n[4] {args.n:,} rows, max_length 2048: apply() in memory vs to an Arrow file"
            " shard by shard (output_path, default shard size)"
        )
        print(_header(SHARD_COLS))
        result["sharded"] = section_sharded(lengths, 2048, args.prewarm_gb, args.seed)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    if args.dry_run:
        print("[packing] dry run: 0 invalid")
    return result


if __name__ == "__main__":
    main()
