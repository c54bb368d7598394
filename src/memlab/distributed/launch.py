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
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memlab.context import BuildContext

GRACE_S = 20.0

CAUSES = ("oom", "killed", "nan", "invalid", "failed", "timeout", "interrupted")
"""Rank statuses from the most to the least likely root cause of a run's end."""


class RankFailed(RuntimeError):
    """A rank did not finish; the message is that rank's error (OOMs keep their wording),
    ``status`` the run's status and ``signal`` the signal that ended that rank (if one did)."""

    def __init__(self, message: str, status: str = "failed", signal: str | None = None):
        super().__init__(message)
        self.status, self.signal = status, signal


def rank_logs(ranks: Path, n: int):
    """Where each rank's output goes (a torch ``LogsSpecs``): rank 0 prints to the terminal;
    rank ``r >= 1`` writes ``rank<r>.log`` (stderr: logs, tracebacks) and ``rank<r>.out``
    (stdout) in the run's ``ranks/`` dir; every rank's error file is ``rank<r>.error.json``
    (``TORCHELASTIC_ERROR_FILE``: torch's ``record`` writes it on an uncaught exception)."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RankLogs(LogsSpecs):
        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            out = {r: "" if r == 0 else str(ranks / f"rank{r}.out") for r in range(n)}
            err = {r: "" if r == 0 else str(ranks / f"rank{r}.log") for r in range(n)}
            return LogsDest(out, err, {}, {}, error_files(ranks, n))

        @property
        def root_log_dir(self) -> str:
            return str(ranks)

    return RankLogs(log_dir=str(ranks))


def error_files(ranks: Path, n: int) -> dict[int, str]:
    return {r: str(ranks / f"rank{r}.error.json") for r in range(n)}


def launch(ctx: BuildContext, summary: dict[str, Any], worker: str) -> None:
    """Start ``ctx.world_size`` ranks of the job in ``summary`` (each ``python -m <worker>
    RUN_DIR``) through torch's launcher API and merge their results into it. Raises RankFailed
    when a rank failed.

    The ranks are torch's ``elastic.multiprocessing.start_processes`` (what torchrun's agent
    runs): standard ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` (plus ``MEMLAB_RANK`` & co., which
    mark memlab's own launch), per-rank log and error files (:func:`rank_logs`), each rank in
    its own session, stopped with SIGTERM then SIGKILL. The rendezvous store is this process's
    (``TCPStore`` on port 0, or ``distributed.master_port``; the ranks connect to it as
    torchrun's agent store: ``TORCHELASTIC_USE_AGENT_STORE``), so no free port is guessed and
    lost to another program between the choice and the bind. torch registers its own stop
    handlers when it starts the ranks; memlab's (:class:`memlab.measure.outcome.StopSignals`:
    a stop is recorded, the ranks record ``interrupted``) are put back at once."""
    import signal as signals

    from torch.distributed.elastic.multiprocessing import start_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from memlab.measure.outcome import STOP_SIGNALS, Interrupted, OomWatch
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
    write_atomic(ranks / "job.json", {k: summary[k] for k in
                                      ("config", "choices", "overrides", "job", "run_dir")})
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
    # start_processes installs its own handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT: the run
    # keeps its own (a stop signal is the run's to record; SIGQUIT stays what it was)
    ours = {sig: signals.getsignal(sig) for sig in (*STOP_SIGNALS, signals.SIGQUIT)}
    pc, watches = None, None
    try:
        try:
            pc = start_processes(name="memlab", entrypoint=sys.executable,
                                 args={r: ("-m", worker, str(run_dir)) for r in range(n)},
                                 envs=envs, logs_specs=rank_logs(ranks, n))
        finally:
            for sig, handler in ours.items():
                signals.signal(sig, handler)
        pids = pc.pids()
        watches = [OomWatch(pids[r]) for r in range(n)]
        codes = _wait(pc, n)
    except (Interrupted, SignalException) as e:  # the run is stopped: so are its ranks,
        codes = _stop(pc, n) if pc else [None] * n  # which record what they measured
        try:
            merge(summary, ranks, n, codes, watches)
        except RankFailed:
            pass
        if isinstance(e, SignalException):
            raise Interrupted(e.sigval) from None
        raise
    except BaseException:
        if pc:
            _stop(pc, n)
        raise
    finally:
        del store
    merge(summary, ranks, n, codes, watches)


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


def _codes(pc, n: int) -> list[int | None]:
    return [pc.subprocess_handlers[r].proc.poll() for r in range(n)]


def _wait(pc, n: int) -> list[int | None]:
    """Every exit code; once one rank fails, the others get GRACE_S to finish, then stop."""
    failed_at = None
    while True:
        codes = _codes(pc, n)
        if all(c is not None for c in codes):
            pc.close()  # nothing left to stop: closes the log files
            return codes
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            return _stop(pc, n)
        time.sleep(0.1)


def _stop(pc, n: int) -> list[int | None]:
    """SIGTERM to every rank still running (each records ``interrupted``), SIGKILL after 10 s
    (torch's ``close``); every exit code."""
    pc.close(signal.SIGTERM, timeout=10)
    return _codes(pc, n)


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
