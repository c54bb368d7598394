"""Multi-process runs on one machine: the run's process starts one worker per rank, waits, and
merges what the ranks measured into the run's ``summary.json``.

Why memlab starts its own ranks instead of running under ``torchrun``: a Hydra run composes its
output directory from the clock, so N ranks started by torchrun would each compose (and create)
their own; sweeps would also need one torchrun per job. Here the Hydra job stays one process
(sweeps, the isolating launcher and summaries work unchanged) and the ranks share its run dir:

    run_dir/ranks/job.json         the resolved config every rank trains from
    run_dir/ranks/rank<r>.json     each rank's own summary (memory, throughput, status)
    run_dir/ranks/rank<r>.log      ranks >= 1: stderr (rank 0 prints to the terminal); .out: stdout
    run_dir/ranks/rank<r>.error.json   an exception that escaped rank r (torch's error file)
    run_dir/summary.json           the merge: rank 0's record, per-rank memory, summed speed

A rank that fails (an OOM on one GPU included) ends the run with that rank's status and error:
when several ranks end badly, the first cause wins (:data:`CAUSES`: a rank killed by the OS
out-of-memory killer or by someone, ``killed``, before the collective errors it causes in the
others); the other ranks, stuck in a collective, are stopped after ``GRACE_S`` seconds. When the
run itself is stopped (SIGINT / SIGTERM), its ranks are stopped too and record ``interrupted``
with what they measured, which is merged before the run records its own end.

Under an external launcher (``torchrun``) every process is a rank already
(:func:`memlab.torchrun.run_rank`); :func:`merge` combines their records the same way.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memlab.context import BuildContext

GRACE_S = 20.0
"""How long the other ranks have to finish once one rank failed."""
STOP_S = 10.0
"""How long a rank has to record ``interrupted`` after SIGTERM before it gets SIGKILL."""

CAUSES = ("oom", "killed", "nan", "invalid", "failed", "timeout", "interrupted")
"""Rank statuses from the most to the least likely root cause of a run's end."""


class RankFailed(RuntimeError):
    """A rank did not finish; the message is that rank's error (OOMs keep their wording),
    ``status`` the run's status and ``signal`` the signal that ended that rank (if one did)."""

    def __init__(self, message: str, status: str = "failed", signal: str | None = None):
        super().__init__(message)
        self.status, self.signal = status, signal


def rank_logs(ranks: Path, n: int) -> dict[int, tuple[str, str] | None]:
    """Where each rank's output goes: rank 0 prints to the run's terminal (None); rank
    ``r >= 1`` writes ``rank<r>.out`` (stdout) and ``rank<r>.log`` (stderr: logs, tracebacks)
    in the run's ``ranks/`` dir. Every rank's error file is ``rank<r>.error.json``
    (:func:`error_files`: torch's ``record`` writes it on an uncaught exception)."""
    return {r: None if r == 0 else (str(ranks / f"rank{r}.out"), str(ranks / f"rank{r}.log"))
            for r in range(n)}


def error_files(ranks: Path, n: int) -> dict[int, str]:
    return {r: str(ranks / f"rank{r}.error.json") for r in range(n)}


def launch(ctx: BuildContext, summary: dict[str, Any], worker: str,
           keep: Sequence[int] = ()) -> None:
    """Start ``ctx.world_size`` ranks of the job in ``summary`` (each what ``python -m <worker>
    RUN_DIR`` would be) and merge their results into it. Raises RankFailed when a rank failed.

    The ranks are forks of a server that imported memlab ahead (:mod:`memlab.distributed.
    starter`: the run's environment, working directory and ``sys.path``, each rank in its own
    session, stopped with SIGTERM then SIGKILL), with torchrun's variables (``RANK`` /
    ``LOCAL_RANK`` / ``WORLD_SIZE``, plus ``MEMLAB_RANK`` & co., which mark memlab's own
    launch), per-rank log and error files (:func:`rank_logs`). The rendezvous store is this
    process's (``TCPStore`` on port 0, or ``distributed.master_port``; the ranks connect to it
    as torchrun's agent store: ``TORCHELASTIC_USE_AGENT_STORE``), so no free port is guessed and
    lost to another program between the choice and the bind. ``keep``: descriptors every rank
    holds until it ends (the run dir's lock: held until the last rank is gone)."""
    from memlab.distributed import starter
    from memlab.measure import runlog
    from memlab.measure.outcome import Interrupted, OomWatch
    from memlab.measure.summary import write_atomic

    multi = ctx.distributed.as_ranks()
    if multi is None:
        raise ValueError(f"distributed={ctx.distributed.name} runs one process; it has no "
                         "ranks to start")
    n = ctx.world_size
    run_dir = Path(ctx.run_dir)
    ranks = run_dir / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    for old in [*ranks.glob("rank*.json"), *ranks.glob("rank*.log"), *ranks.glob("rank*.out")]:
        old.unlink()
    write_atomic(ranks / "job.json", {**{k: summary[k] for k in
                                         ("config", "choices", "overrides", "job", "run_dir")},
                                      "log": runlog.file_plan()})  # rank 0 logs into it too
    store = _store(multi.master_port)
    # the ranks import what this process can (a reward function in the user's module, say)
    path = [p for p in sys.path if p and os.path.isdir(p)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    errors = error_files(ranks, n)
    envs = {r: {"MEMLAB_RANK": str(r), "MEMLAB_LOCAL_RANK": str(r), "MEMLAB_WORLD_SIZE": str(n),
                "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_ERROR_FILE": errors[r], "PYTHONPATH": os.pathsep.join(path)}
            for r in range(n)}
    pc, watches = None, None
    try:
        pc = starter.start(worker, str(run_dir), envs, rank_logs(ranks, n),
                           preload=not _cuda_present(), keep=keep)
        pids = pc.pids()
        watches = [OomWatch(pids[r]) for r in range(n)]
        codes = _wait(pc)
    except Interrupted:  # the run is stopped: so are its ranks,
        codes = pc.stop(timeout=STOP_S) if pc else [None] * n  # which record what they measured
        try:
            merge(summary, ranks, n, codes, watches)
        except RankFailed:
            pass
        raise
    except BaseException:
        if pc:
            pc.stop(timeout=STOP_S)
        raise
    finally:
        del store
    merge(summary, ranks, n, codes, watches, pc.stopped)


def _store(port: int):
    """The rendezvous store on 127.0.0.1:``port`` (0: a port the OS gives). A port another
    program holds is the configuration's problem (``invalid``), named with its fix."""
    from torch.distributed import DistNetworkError, TCPStore

    from memlab.registry import ConfigErrors

    try:
        return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    except DistNetworkError as e:
        if not port:
            raise
        raise ConfigErrors([f"distributed.master_port={port}: the port is in use on 127.0.0.1 "
                            "(another program, or another run); choose another port, or 0 "
                            "(the default: one the OS gives)"]) from e


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _wait(pc) -> list[int | None]:
    """Every exit code; once one rank fails, the others get GRACE_S to finish, then stop."""
    failed_at = None
    while True:
        codes = pc.codes()
        if all(c is not None for c in codes):
            return codes
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            return pc.stop(timeout=STOP_S)
        time.sleep(0.1)


def merge(summary: dict[str, Any], ranks: Path, n: int, codes: list[int | None],
          watches: list[Any] | None = None, stopped: Collection[int] = ()) -> None:
    """Rank 0's record, plus what differs per rank; throughput summed over ranks. Raises
    :class:`RankFailed` with the run's status when a rank did not finish (``watches``: each
    rank's :class:`memlab.measure.outcome.OomWatch`, to tell the OOM killer from a kill;
    ``stopped``: the ranks this process stopped after another one ended, which had stopped
    responding)."""
    recs: list[dict[str, Any] | None] = []
    for r in range(n):
        f = ranks / f"rank{r}.json"
        recs.append(json.loads(f.read_text()) if f.exists() else None)
    bad = [(r, rec) for r, rec in enumerate(recs) if rec is None or rec["status"] != "ok"]
    first = recs[0] or next((x for x in recs if x), None)
    if first is not None:
        for key in ("memory", "data", "train", "device", "throughput", "eval", "logger"):
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
        raise _first_cause(bad, codes, ranks, watches, stopped)


def _first_cause(bad: list[tuple[int, dict[str, Any] | None]], codes: list[int | None],
                 ranks: Path, watches: list[Any] | None,
                 stopped: Collection[int] = ()) -> RankFailed:
    """The error of the rank whose end most likely caused the others' (:data:`CAUSES`). A rank
    this process had to stop (``stopped``: still running GRACE_S after another rank ended) is
    named as one that stopped responding, never as the cause when another rank has one."""
    from memlab.measure.outcome import killed_status

    hung = sorted(r for r, _ in bad if r in stopped)
    if hung and len(hung) < len(bad):
        bad = [(r, rec) for r, rec in bad if r not in stopped]
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
    if hung and r not in hung:
        names = ", ".join(map(str, hung))
        return RankFailed(f"rank{'s' if len(hung) > 1 else ''} {names} stopped responding "
                          f"(memlab stopped {'them' if len(hung) > 1 else 'it'} {GRACE_S:.0f} s "
                          f"after rank {r} ended); rank {r} {status}: {why}",
                          status=status, signal=sig)
    return RankFailed(f"rank {r} {status}: {why}", status=status, signal=sig)
