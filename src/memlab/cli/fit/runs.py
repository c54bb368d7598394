"""``memlab fit``'s measured runs: a candidate trained for a few steps in its own process, stopped
in order when fit is, and read back from its summary (:func:`run_once`, :func:`read_run`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _short(error: Any, limit: int = 160) -> str:
    text = " ".join(str(error or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


STOP_GRACE_S = 60.0
"""Seconds a measured run has to record what it measured once fit stops it (then SIGKILL)."""

UNFINISHED = ("interrupted", "killed")
"""Statuses of a measured run that was stopped from outside: not a measurement of the
candidate (it might fit), so the search stops without a verdict."""


class SearchInterrupted(KeyboardInterrupt):
    """The search stopped without a verdict: fit was stopped (SIGTERM, SIGHUP; Ctrl-C is a
    plain KeyboardInterrupt), or a measured run was interrupted or killed from outside.
    ``signal``: the signal's name."""

    def __init__(self, why: str, signal: str):
        super().__init__(why)
        self.signal = signal


def run_command(overrides: list[str], steps: int, run_dir: Path) -> list[str]:
    """The command line of a measured run: ``steps`` steps of ``overrides`` into ``run_dir``
    (``train.epochs=null``: a measured run is its steps, whatever the user's ``train.epochs``,
    which excludes ``train.steps``)."""
    return [sys.executable, "-m", "memlab", *overrides, f"train.steps={steps}",
            "train.epochs=null", "train.progress=false", f"hydra.run.dir={run_dir}"]


def run_once(overrides: list[str], steps: int, run_dir: Path) -> dict[str, Any]:
    """Train ``overrides`` for ``steps`` steps in its own process (:func:`_start`); what its
    summary says (:func:`read_run`). The run has its own session (a Ctrl-C reaches fit, not the
    run) and its console in ``<run_dir>.log`` (no pipe to break when fit ends). Whatever stops fit while the
    run trains stops the run in order too (:func:`stop_run`), and is raised again."""
    cmd = run_command(overrides, steps, run_dir)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    from memlab.measure.summary import unlink_link

    log = run_log(run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    unlink_link(log)  # a link planted there is replaced, never followed out of the directory
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with open(fd, "wb") as out:
        proc = _start(cmd, env, out.fileno())
    try:
        proc.wait()
    except BaseException:
        stop_run(proc)
        raise
    return read_run(run_dir, proc.returncode, time.perf_counter() - t0)


def _start(cmd: list[str], env: dict[str, str], out: int) -> Any:
    """The measured run's process, in its own session: forked from memlab's fork server where
    one serves it (:mod:`memlab.distributed.starter`: a CPU machine, the same import-time
    environment; the ~3.5 s of imports a fresh interpreter spends saved), else ``cmd`` run."""
    from memlab.distributed import starter

    if cmd[:3] == [sys.executable, "-m", "memlab"] and starter.serves(env):
        return starter.Forked(starter.fork("memlab", cmd[3:], env, out, out, preload=True,
                                           orphan_kill_s=None, name="fit-run"))
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_log(run_dir: Path) -> Path:
    """Where a measured run's console goes (beside its run dir)."""
    return run_dir.with_name(run_dir.name + ".log")


def stop_run(proc: Any) -> None:
    """SIGTERM to a measured run (it records ``interrupted`` with what it measured and stops
    its ranks), SIGKILL to its session after :data:`STOP_GRACE_S` or at a second stop."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()


def read_run(run_dir: Path, code: int | None = None,
             seconds: float | None = None) -> dict[str, Any]:
    """A measured run as fit keeps it, from its summary (a run that wrote none: ``failed`` with
    its console's last lines, or what the signal that ended it says)."""
    from memlab.measure.outcome import killed_status

    wall = None if seconds is None else round(seconds, 1)
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        if code is not None and code < 0:
            status, error = killed_status(-code, None)
        else:
            try:
                tail = run_log(run_dir).read_text(errors="replace")[-400:]
            except OSError:
                tail = ""
            status, error = "failed", tail or f"exited with code {code} and wrote no summary"
        return {"status": status, "error": _short(error), "run_dir": str(run_dir),
                "wall_s": wall}
    mem, thr = s.get("memory") or {}, s.get("throughput") or {}
    cuda = mem.get("cuda") or {}
    peak = cuda.get("peak_reserved_bytes") or mem.get("peak_bytes")
    return {"status": s["status"], "error": _short(s.get("error")), "run_dir": str(run_dir),
            "peak_bytes": peak, "tracker_peak_bytes": mem.get("peak_bytes"),
            "tokens_per_s": thr.get("tokens_per_s"), "tokens_per_s_std": thr.get("tokens_per_s_std"),
            "timed_steps": thr.get("timed_steps"),
            "loss_curve": (s.get("train") or {}).get("loss_curve"),
            **({"signal": s["signal"]} if s.get("signal") else {}),
            "wall_s": wall}
