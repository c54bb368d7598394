"""How a job ends, recorded: every way a run ends (ok, invalid, oom, nan, failed, interrupted:
:mod:`memlab.measure.outcome`) ends in an atomically written summary.json holding everything
measured so far; when the run dir cannot be written, the summary goes to a fallback path that
the run prints and records (:func:`memlab.measure.summary.write_summary`). Used by every launch
mode: a run (:mod:`memlab.run`), a memlab-launched rank (:mod:`memlab.rank`), a torchrun rank
(:mod:`memlab.torchrun`), the Hydra task (:mod:`memlab.hydra_task`).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memlab import faults
from memlab.data.base import DataError
from memlab.measure.outcome import Interrupted, NonFiniteLoss, StopSignals
from memlab.measure.summary import versions, write_summary, write_text_atomic
from memlab.registry import ConfigErrors

Body = Callable[[list], None]
"""What :func:`guarded` runs: ``body(logger_box)``; a started logger is appended to the box so
that the record reaches it whatever happens."""


def guarded(body: Body, summary: dict[str, Any], out: Path,
            on_end: Callable[[dict[str, Any], list], None] | None = None) -> dict[str, Any]:
    """Run ``body(logger_box)``, record how it ended in ``summary`` (:func:`record_end`) and
    write it to ``out`` (or to a fallback path, named in ``summary["write_error"]`` and printed,
    when ``out``'s dir cannot be written); ``on_end(summary, logger_box)`` runs before the
    record is written when the job did not end ``ok`` (:func:`memlab.run.late_logger`: a job
    that ended before its logger started is logged all the same). Never raises for a failing job; SIGINT / SIGTERM stop
    the body (status ``interrupted``). A stop signal that arrives while the record is made is
    held until it is written and then raised (:class:`Interrupted`); so is any failure under
    ``MEMLAB_RAISE=1`` (debugging)."""
    t0 = time.perf_counter()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # recorded when the summary cannot be written there
    logger_box: list = []
    ended: BaseException | None = None
    with StopSignals() as stop:
        try:
            with stop.live():
                summary["versions"] = versions()
                body(logger_box)
        except BaseException as e:  # noqa: BLE001 - recorded below, never swallowed silently
            ended = e
        # from here on a stop signal waits: the record is written whole
        record_end(summary, ended)
        if on_end is not None and summary["status"] != "ok":
            on_end(summary, logger_box)
        if ended is not None and summary["status"] in ("failed", "oom", "nan"):
            _write_traceback(out, ended)
        faults.reach("summary")
        summary["wall_time_s"] = time.perf_counter() - t0
        try:
            _, why = write_summary(out, summary)
            if why:
                print(f"[memlab] {why}", file=sys.stderr, flush=True)
        except OSError as e:
            print(f"[memlab] could not write {out} nor any fallback ({e}); the summary is "
                  "only printed", file=sys.stderr, flush=True)
        if logger_box:
            try:
                logger_box[0].finish(summary)
            except Exception as e:  # noqa: BLE001
                print(f"[memlab] logger.finish failed: {e}")
    if stop.held is not None and summary["status"] != "interrupted":
        raise stop.held
    if ended is not None and os.environ.get("MEMLAB_RAISE") and summary["status"] != "ok":
        raise ended
    return summary


def record_end(summary: dict[str, Any], ended: BaseException | None) -> None:
    """Set ``summary["status"]`` and ``["error"]`` from how the body ended (``None``: it
    returned): invalid configuration, data, model files or checkpoint, a stop signal (with ``signal``), a non-finite
    loss (``train.nan_step``), a failed rank (that rank's status), out of memory, or failed."""
    from memlab.distributed.launch import RankFailed
    from memlab.model._files import ModelFilesError
    from memlab.trainer.checkpoint import CheckpointError

    if ended is None:
        summary["status"], summary["error"] = "ok", None
        return
    e = ended
    if isinstance(e, (ConfigErrors, DataError)):
        status, error = "invalid", str(e)
    elif isinstance(e, (ModelFilesError, CheckpointError)):  # the input's fault, named in it
        status, error = "invalid", f"{type(e).__name__}: {e}"
    elif isinstance(e, (Interrupted, KeyboardInterrupt)):
        sig = e.signal if isinstance(e, Interrupted) else "SIGINT"
        steps = (summary.get("train") or {}).get("steps")
        status = "interrupted"
        error = f"interrupted by {sig}" + (f" after {steps} step(s)" if steps is not None
                                           else " before training started")
        summary["signal"] = sig
    elif isinstance(e, NonFiniteLoss):
        status, error = "nan", str(e)
        if summary.get("train") is not None:
            summary["train"]["nan_step"] = e.step
    elif isinstance(e, RankFailed):
        status, error = e.status, f"{type(e).__name__}: {e}"
        if e.signal:
            summary["signal"] = e.signal
    else:
        from memlab.measure.memory import is_oom

        status = "oom" if is_oom(e) else "failed"
        error = f"{type(e).__name__}: {e}"
    summary["status"], summary["error"] = status, error


def _write_traceback(out: Path, e: BaseException) -> None:
    """The failure's traceback beside the summary (skipped when that dir cannot be written)."""
    name = "error.txt" if out.name == "summary.json" else f"{out.stem}.error.txt"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out.parent / name, "".join(traceback.format_exception(e)))
    except OSError:
        pass


def exit_code(summary: dict[str, Any]) -> int:
    """A single run's exit status: 0 ok, 2 invalid, 128 + the signal when interrupted (130 for
    Ctrl-C, 143 for SIGTERM, 129 for SIGHUP), 1 otherwise."""
    import signal

    status = summary.get("status")
    if status == "ok":
        return 0
    if status == "invalid":
        return 2
    if status == "interrupted":
        return 128 + int(getattr(signal, summary.get("signal") or "SIGINT", signal.SIGINT))
    return 1


def read_back(path: Path, record_id: str) -> dict[str, Any]:
    """The record this run (``record_id``) wrote for ``path`` (there or at a fallback path)."""
    from memlab.measure.summary import read_summary

    return read_summary(path, record_id) or {"status": "failed",
                                             "error": f"no record of this run at {path}"}
