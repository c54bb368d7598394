"""What knowing data and model files by their content costs (issue 43, item 2).

memlab hashes every data file it reads (:func:`memlab.trainer.inputs.file_sha256`: SHA-256,
read in 1 MiB chunks): the hash names the file's ``datasets`` cache, goes into summary.json
and into each checkpoint, and a resume compares it. Cases, best of ``--repeats`` (the spread
shown), each file's page cache warm or evicted (``posix_fadvise(DONTNEED)`` after an fsync:
"cold", as after a reboot or when the file is larger than memory):

* a ``--mb`` MB JSONL of chat rows: read only (the floor), SHA-256 warm and cold, with the peak
  RSS the hash adds; ``data=local``'s load with an empty ``datasets`` cache (UTF-8 check + hash
  + prepare) and with a warm one (UTF-8 check + hash + cache hit), its UTF-8 check alone (a
  pass over the lines that predates the hash) and ``datasets.load_dataset`` on the same warm
  cache without either (the load less both: what the hash adds to a run whose rows are cached);
* a ``--model-gb`` GB ``model.safetensors`` (random bytes, one tensor), as in a local
  ``model.name_or_path`` directory: SHA-256 of the whole file warm and cold, the header alone
  (what hashing "only the headers" would cost), and ``safetensors.torch.load_file`` plus a copy
  of the tensor, warm and cold (the read of the weights every resume does anyway).

Usage: ``PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/data_hashing.py [--mb 200]
[--model-gb 1] [--repeats 3] [--workdir DIR] [--out PATH]``; ``--dry-run``: a 2 MB file, a
4 MB model, one round, its JSON in the temp dir (the suite runs it: every case still runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (they are clean: written and fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_only(path: Path) -> None:
    buf = bytearray(1 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _peak_rss_reset() -> bool:
    """Reset the process's peak RSS (Linux ``clear_refs``); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def write_rows(path: Path, mb: float) -> int:
    """A JSONL of chat rows of about ``mb`` MB; its row count."""
    target, n = int(mb * 1e6), 0
    with path.open("w") as f:
        while f.tell() < target:
            lines = []
            for i in range(n, n + 1000):
                lines.append(json.dumps({"messages": [
                    {"role": "user", "content": f"question {i}: what is {i} times {i % 97}?"},
                    {"role": "assistant", "content": f"{i} times {i % 97} is "
                     f"{i * (i % 97)}. " * 3}]}))
            f.write("\n".join(lines) + "\n")
            n += 1000
        f.flush()
        os.fsync(f.fileno())
    return n


def write_safetensors(path: Path, gb: float) -> int:
    """A safetensors file of one uint8 tensor of about ``gb`` GB (random bytes); its size."""
    n = int(gb * 1e9)
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "weight": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        left = n
        while left:
            k = min(left, 64 << 20)
            f.write(os.urandom(k))
            left -= k
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def header_sha256(path: Path) -> str:
    """SHA-256 of a safetensors file's header alone (8-byte length + JSON)."""
    import hashlib

    with path.open("rb") as f:
        size = f.read(8)
        return hashlib.sha256(size + f.read(struct.unpack("<Q", size)[0])).hexdigest()


def timed(fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None
          ) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"best_s": min(times), "worst_s": max(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="size of the JSONL (MB)")
    ap.add_argument("--model-gb", type=float, default=1.0, help="size of the weights (GB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where the files go (default: a temp dir, "
                    "removed at the end)")
    ap.add_argument("--out", default=None, help="results JSON (default: results/"
                    "data_hashing.json; --dry-run: the temp dir)")
    ap.add_argument("--dry-run", action="store_true", help="tiny files, one round")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.mb, a.model_gb, a.repeats = 2.0, 0.004, 1
    sys.path.insert(0, str(REPO / "src"))
    import datasets
    from safetensors.torch import load_file

    from memlab.data import local as local_module
    from memlab.data.local import Local
    from memlab.trainer import inputs

    own = a.workdir is None
    work = Path(a.workdir or tempfile.mkdtemp(prefix="memlab-hashing-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(a.out) if a.out else (
        Path(tempfile.gettempdir()) / "memlab-data_hashing-dry-run.json" if a.dry_run
        else REPO / "benchmarks" / "results" / "data_hashing.json")
    was = datasets.config.HF_DATASETS_CACHE, datasets.are_progress_bars_disabled()
    datasets.config.HF_DATASETS_CACHE = str(work / "datasets-cache")  # ours, emptied below
    datasets.disable_progress_bars()
    try:
        rows_path = work / "rows.jsonl"
        n_rows = write_rows(rows_path, a.mb)
        rows_mb = rows_path.stat().st_size / 1e6
        model = work / "model" / "model.safetensors"
        model.parent.mkdir(exist_ok=True)
        model_gb = write_safetensors(model, a.model_gb) / 1e9

        def sha(path: Path) -> Callable[[], str]:
            def run() -> str:
                inputs._HASHES.clear()  # hash for real, every round
                return inputs.file_sha256(path)
            return run

        def empty_cache() -> None:
            shutil.rmtree(work / "datasets-cache", ignore_errors=True)
            inputs._HASHES.clear()

        local = Local(path=str(rows_path))

        def read_weights() -> None:  # load_file maps the file: copying reads it, as loading does
            load_file(model)["weight"].clone()

        cases: dict[str, dict[str, float]] = {}
        cases["data: read only, warm"] = timed(lambda: _read_only(rows_path), a.repeats)
        cases["data: sha256, warm"] = timed(sha(rows_path), a.repeats)
        cases["data: sha256, cold"] = timed(sha(rows_path), a.repeats,
                                            lambda: _evict(rows_path))
        reset = _peak_rss_reset()
        base = _rss_mib("VmRSS")
        sha(rows_path)()
        peak = _rss_mib("VmHWM")
        hash_rss = (peak - base) if reset and peak is not None and base is not None else None
        cases["data: utf-8 check"] = timed(lambda: local_module._encoding_problem(rows_path),
                                           a.repeats)
        cases["data: load, empty cache"] = timed(lambda: local.load(None), a.repeats,
                                                 empty_cache)
        cases["data: load, cached"] = timed(lambda: local.load(None), a.repeats,
                                            inputs._HASHES.clear)
        name = f"sha256-{inputs.content_key([rows_path])}"  # the same cache, no hashing
        cases["data: datasets alone, cached"] = timed(
            lambda: datasets.load_dataset("json", name=name, data_files=[str(rows_path)],
                                          split="train"), a.repeats)
        cases["model: sha256, warm"] = timed(sha(model), a.repeats)
        cases["model: sha256, cold"] = timed(sha(model), a.repeats, lambda: _evict(model))
        cases["model: header only, cold"] = timed(lambda: header_sha256(model), a.repeats,
                                                  lambda: _evict(model))
        cases["model: load_file, warm"] = timed(read_weights, a.repeats)
        cases["model: load_file, cold"] = timed(read_weights, a.repeats, lambda: _evict(model))
    finally:
        datasets.config.HF_DATASETS_CACHE = was[0]
        if not was[1]:
            datasets.enable_progress_bars()
        if own:
            shutil.rmtree(work, ignore_errors=True)

    sizes = {"data": rows_mb, "model": model_gb * 1e3}
    load = [round(x, 1) for x in os.getloadavg()]
    print(f"data: {rows_mb:.0f} MB, {n_rows} rows; model: {model_gb * 1e3:.0f} MB; best of "
          f"{a.repeats}; {os.cpu_count()} CPUs, load average {load}")
    print(f"{'case':32s} {'best s':>8s} {'MB/s':>8s} {'spread s':>14s}")
    for name, r in cases.items():
        mb = sizes[name.split(":")[0]]
        r["mb_per_s"] = mb / r["best_s"] if r["best_s"] > 0 else float("inf")
        if "header only" in name:
            r["mb_per_s"] = float("nan")  # reads a few bytes, not the file
        print(f"{name:32s} {r['best_s']:8.3f} {r['mb_per_s']:8.0f} "
              f"{r['best_s']:6.3f}-{r['worst_s']:.3f}")
    c = {k: v["best_s"] for k, v in cases.items()}
    print(f"a cached load of {rows_mb:.0f} MB: {c['data: load, cached']:.2f} s (measured apart: "
          f"the hash {c['data: sha256, warm']:.2f} s, the UTF-8 check "
          f"{c['data: utf-8 check']:.2f} s, datasets {c['data: datasets alone, cached']:.2f} s); "
          f"hashing holds {hash_rss if hash_rss is not None else float('nan'):.1f} MiB more RSS "
          "at its peak")
    print(f"model: the whole file hashes in {c['model: sha256, cold'] / model_gb:.2f} s/GB cold, "
          f"{c['model: sha256, warm'] / model_gb:.2f} s/GB warm; reading the weights takes "
          f"{c['model: load_file, cold'] / model_gb:.2f} s/GB cold")
    result = {"rows": n_rows, "data_mb": rows_mb, "model_gb": model_gb, "repeats": a.repeats,
              "dry_run": a.dry_run, "machine": platform.platform(), "cpus": os.cpu_count(), "load_average": load,
              "hash_peak_rss_added_mib": hash_rss,
              "cases": {k: {kk: (None if vv != vv else vv) for kk, vv in v.items()}
                        for k, v in cases.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
