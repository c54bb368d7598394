"""Multi-process runs on one machine: the run's process starts one worker per rank, waits, and
merges what the ranks measured into the run's ``summary.json``.

Why memlab starts its own ranks instead of running under ``torchrun``: a Hydra run composes its
output directory from the clock, so N ranks started by torchrun would each compose (and create)
their own; sweeps would also need one torchrun per job. Here the Hydra job stays one process
(sweeps, the isolating launcher and summaries work unchanged) and the ranks share its run dir:

    run_dir/ranks/job.json         the resolved config every rank trains from
    run_dir/ranks/rank<r>.json     each rank's own summary (memory, throughput, status)
    run_dir/ranks/rank<r>.log      ranks >= 1 (rank 0 prints to the terminal)
    run_dir/summary.json           the merge: rank 0's record, per-rank memory, summed speed

A rank that fails (an OOM on one GPU included) ends the run with that rank's status and error:
when several ranks end badly, the first cause wins (:data:`CAUSES`: a rank killed by the OS
out-of-memory killer or by someone, ``killed``, before the collective errors it causes in the
others); the other ranks, stuck in a collective, are stopped after ``GRACE_S`` seconds. When the
run itself is stopped (SIGINT / SIGTERM), its ranks are stopped too and record ``interrupted``
with what they measured, which is merged before the run records its own end.

Under an external launcher (``torchrun``) every process is a rank already
(``memlab.run.run_external``); :func:`merge` combines their records the same way.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GRACE_S = 20.0

CAUSES = ("oom", "killed", "nan", "invalid", "failed", "timeout", "interrupted")
"""Rank statuses from the most to the least likely root cause of a run's end."""


class RankFailed(RuntimeError):
    """A rank did not finish; the message is that rank's error (OOMs keep their wording),
    ``status`` the run's status and ``signal`` the signal that ended that rank (if one did)."""

    def __init__(self, message: str, status: str = "failed", signal: str | None = None):
        super().__init__(message)
        self.status, self.signal = status, signal


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ctx, summary: dict[str, Any], worker: str) -> None:
    """Start ``ctx.world_size`` ranks of the job in ``summary`` (each ``python -m <worker>
    RUN_DIR``) and merge their results into it. Raises RankFailed when a rank failed."""
    from memlab.measure.outcome import Interrupted, OomWatch
    from memlab.measure.summary import write_atomic

    n = ctx.world_size
    run_dir = Path(ctx.run_dir)
    ranks = run_dir / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    for old in ranks.glob("rank*.json"):
        old.unlink()
    write_atomic(ranks / "job.json", {k: summary[k] for k in
                                      ("config", "choices", "overrides", "job", "run_dir")})
    port = getattr(ctx.distributed, "master_port", 0) or free_port()
    # the ranks import what this process can (a reward function in the user's module, say)
    path = [p for p in sys.path if p and os.path.isdir(p)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    procs: list[subprocess.Popen] = []
    watches: list[OomWatch] = []
    logs = []
    try:
        for r in range(n):
            env = {**os.environ, "MEMLAB_RANK": str(r), "MEMLAB_LOCAL_RANK": str(r),
                   "MEMLAB_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join(path)}
            out = None
            if r > 0:
                out = open(ranks / f"rank{r}.log", "w")  # noqa: SIM115 - closed below
                logs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", worker, str(run_dir)], env=env,
                stdout=out, stderr=subprocess.STDOUT if out else None))
            watches.append(OomWatch(procs[-1].pid))
        codes = _wait(procs)
    except Interrupted:  # the run is stopped: so are its ranks, which record what they measured
        codes = _stop(procs)
        try:
            merge(summary, ranks, n, codes, watches)
        except RankFailed:
            pass
        raise
    except BaseException:
        _stop(procs)
        raise
    finally:
        for f in logs:
            f.close()
    merge(summary, ranks, n, codes, watches)


def _wait(procs: list[subprocess.Popen]) -> list[int | None]:
    """Every exit code; once one rank fails, the others get GRACE_S to finish, then stop."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            _stop(procs)
            return [p.wait() for p in procs]
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> list[int | None]:
    """SIGTERM to every rank still running (each records ``interrupted``), SIGKILL after 10 s;
    every exit code."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def merge(summary: dict[str, Any], ranks: Path, n: int, codes: list[int | None],
          watches: list[Any] | None = None) -> None:
    """Rank 0's record, plus what differs per rank; throughput summed over ranks. Raises
    :class:`RankFailed` with the run's status when a rank did not finish (``watches``: each
    rank's :class:`memlab.measure.outcome.OomWatch`, to tell the OOM killer from a kill)."""
    recs: list[dict[str, Any] | None] = []
    for r in range(n):
        f = ranks / f"rank{r}.json"
        recs.append(json.loads(f.read_text()) if f.exists() else None)
    bad = [(r, rec) for r, rec in enumerate(recs) if rec is None or rec["status"] != "ok"]
    first = recs[0] or next((x for x in recs if x), None)
    if first is not None:
        for key in ("memory", "data", "train", "device", "throughput"):
            summary[key] = first.get(key)
    ok = [x for x in recs if x and x.get("status") == "ok"]
    summary["distributed"] = {
        "world_size": n,
        "exit_codes": codes,
        "ranks": [None if x is None else {
            "status": x["status"], "error": x.get("error"),
            "peak_bytes": (x.get("memory") or {}).get("peak_bytes"),
            "by_category": (x.get("memory") or {}).get("by_category"),
            "cuda": (x.get("memory") or {}).get("cuda"),
            "wrapper": (x.get("memory") or {}).get("distributed"),
            "tokens_per_s": (x.get("throughput") or {}).get("tokens_per_s"),
            "tokens_trained": (x.get("data") or {}).get("tokens_trained"),
        } for x in recs],
    }
    if summary.get("memory") and ok:
        peaks = [x["memory"]["peak_bytes"] for x in ok if x.get("memory")]
        summary["memory"]["peak_bytes_max_rank"] = max(peaks) if peaks else None
    if len(ok) == n:
        tps = [(x.get("throughput") or {}).get("tokens_per_s") for x in ok]
        thr = dict(summary.get("throughput") or {})
        if all(t is not None for t in tps):
            thr["tokens_per_s_rank0"] = thr.get("tokens_per_s")
            thr["tokens_per_s"] = sum(tps)
            sps = [(x.get("throughput") or {}).get("samples_per_s") or 0 for x in ok]
            thr["samples_per_s"] = sum(sps)
            thr["note"] = f"summed over {n} ranks"
        summary["throughput"] = thr
        summary["data"]["tokens_trained"] = sum(x["data"]["tokens_trained"] for x in ok)
    if bad:
        raise _first_cause(bad, codes, ranks, watches)


def _first_cause(bad: list[tuple[int, dict[str, Any] | None]], codes: list[int | None],
                 ranks: Path, watches: list[Any] | None) -> RankFailed:
    """The error of the rank whose end most likely caused the others' (:data:`CAUSES`)."""
    from memlab.measure.outcome import killed_status

    found = []
    for r, rec in bad:
        code = codes[r] if r < len(codes) else None
        if rec is not None:
            status, why, sig = rec["status"], rec.get("error"), rec.get("signal")
        elif code is not None and code < 0:
            status, why = killed_status(-code, watches[r] if watches else None)
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = None
        else:
            status, why, sig = "failed", (f"exited with code {code} and wrote no summary "
                                          f"(see {ranks}/rank{r}.log)"), None
        rank_of = CAUSES.index(status) if status in CAUSES else len(CAUSES)
        found.append((rank_of, r, status, why, sig))
    _, r, status, why, sig = min(found)
    return RankFailed(f"rank {r} {status}: {why}", status=status, signal=sig)
