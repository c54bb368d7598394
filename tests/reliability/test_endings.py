"""Endings that used to leave no record, or a wrong one: a full disk under a checkpoint, a sweep
hung up (SIGHUP), a sweep stopped twice (Ctrl-C, Ctrl-C), a sweep dir that cannot be written from
the start, ``memlab fit`` stopped (SIGTERM, Ctrl-C) or its measured run stopped from outside. Each
acts once a run is paused at its fault hook (:mod:`memlab.faults`), never on timing; each checks
the record left: summary.json, the job's memlab.log, fit.json, the exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memlab.measure.summary import FALLBACK_ENV
from memlab_testing import REPO, check_record
from reliability.helpers import (
    ENV,
    HANG_S,
    SMOKE,
    memlab_popen,
    pause_env,
    wait_for_marker,
)
from reliability.test_shared_dirs import QUIET, app

pytestmark = pytest.mark.integration

CONF = Path(__file__).parent / "conf"
PINNED = [*QUIET, "precision=fp32"]
"""The runs here pin their precision (the default, auto, depends on the CPU's bf16 kernels)."""


def _summary(run_dir: Path) -> dict:
    return check_record(run_dir / "summary.json")


def wait_for_text(log: Path, text: str, proc: subprocess.Popen) -> None:
    """Until ``text`` is in ``log`` (what ``proc`` prints); fails at once when ``proc`` ended
    first."""
    deadline = time.monotonic() + HANG_S
    while text not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, f"ended (code {proc.returncode}) before printing {text!r}"
        assert time.monotonic() < deadline, f"hang guard: {text!r} never printed"
        time.sleep(0.05)


# ------------------------------------------------------------------------------- a full disk
def test_a_full_disk_keeps_training_records_checkpoint_errors_and_leaves_no_partial_dir(
        tmp_path):
    """The job's files may not grow past 512 KiB (``RLIMIT_FSIZE``: writes fail with EFBIG, as
    they do with ENOSPC on a full disk; no root needed): the record fits, a checkpoint (a 1 MiB
    ``model.safetensors``, written by safetensors' Rust writer, which raises its own error type)
    does not."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    limit = 512 * 1024
    small_files = ("import resource, runpy, sys; "
                   f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
                   "sys.argv = ['memlab', *sys.argv[1:]]; "
                   "runpy.run_module('memlab', run_name='__main__')")
    with open(log, "w") as out:
        code = subprocess.run(
            [sys.executable, "-c", small_files, *PINNED, "train.save_every=2",
             "train.save_final=true", f"hydra.run.dir={run_dir}"],
            cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT, timeout=HANG_S).returncode
    s = _summary(run_dir)
    assert code == 1 and s["status"] == "failed", log.read_text()[-3000:]
    assert s["train"]["steps"] == 3 and len(s["train"]["loss_curve"]) == 3  # trained on
    errors = s["checkpoint"]["errors"]
    assert [e.split(":")[0] for e in errors] == ["step 2", "step 3"], errors
    assert all("File too large" in e for e in errors), errors
    assert "checkpoint not written" in s["error"] and s["memory"]["peak_bytes"] > 0
    assert s["train"]["checkpoint"] is None
    assert not list((run_dir / "checkpoints").iterdir())  # no .tmp_step_* left behind


# ---------------------------------------------------------------------------------- sweeps
def _stopped_sweep(tmp_path, args: list[str], act, pinned=PINNED) -> tuple[int, str]:
    """A sweep (``memlab -m`` of the reliability configs with ``args``) into ``tmp_path/sweep``,
    in a subprocess whose jobs pause under ``tmp_path/rel`` (``REL_DIR``); ``act(proc, log)``
    while it runs (it waits at the jobs' markers), then the sweep's exit status and console.
    The sweep is killed if it outlives the test."""
    log = tmp_path / "sweep.log"
    proc = memlab_popen(["-m", "--config-dir", str(CONF), *args, *pinned,
                         f"hydra.sweep.dir={tmp_path / 'sweep'}"], log,
                        env={"REL_DIR": str(tmp_path / "rel")})
    try:
        act(proc, log)
        code = proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, log.read_text()


def test_a_hung_up_sweep_records_every_job_and_each_job_log_holds_its_console(tmp_path):
    """The job's memlab.log holds its console (the last state of each progress bar, no runs of
    ``\\r`` updates) and the lines the console leaves out (one a logging interval), each once;
    the sweep's console shows the bars live."""
    sweep, rel, outside = tmp_path / "sweep", tmp_path / "rel", tmp_path / "outside"
    outside.write_text("precious")
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "memlab.log").symlink_to(outside)  # a link where the job's log goes

    def hang_up(proc, log):
        wait_for_marker(rel / "interrupted", "step:1", proc, log)
        proc.send_signal(signal.SIGHUP)  # the terminal closed

    bars = [*SMOKE, "precision=fp32", "train.progress=true"]
    code, out = _stopped_sweep(tmp_path, ["experiment=rel_interrupted,rel_not_run"], hang_up,
                               bars)
    assert code == 128 + signal.SIGHUP, out[-3000:]
    assert "[memlab] sweep interrupted by SIGHUP: 2 jobs: 1 interrupted, 1 not_run" in out
    first, second = _summary(sweep / "0"), _summary(sweep / "1")
    assert first["status"] == "interrupted" and first["signal"] == "SIGHUP"
    assert first["error"] == "interrupted by SIGHUP after 1 step(s)"
    assert len(first["train"]["loss_curve"]) == 1 and first["memory"]["peak_bytes"] > 0
    assert second["status"] == "not_run" and "interrupted by SIGHUP" in second["error"]
    job_log = sweep / "0" / "memlab.log"
    assert not job_log.is_symlink() and outside.read_text() == "precious"
    text = job_log.read_text()
    assert "status: interrupted  (interrupted by SIGHUP after 1 step(s))" in text
    assert "peak memory (tracker, cpu)" in text and "status: interrupted" in out  # and echoed
    # the console's bars live, the log's at rest (read as bytes: text mode reads \r as \n)
    assert b"\r" not in job_log.read_bytes()
    assert b"\rtrain:" in (tmp_path / "sweep.log").read_bytes()
    lines = text.splitlines()
    (tokenize,) = [x for x in lines if x.startswith("tokenize:")]  # one bar, the data's
    (train,) = [x for x in lines if x.startswith("train:") and "|" in x]  # its bar
    assert "100%" in tokenize and "1/3" in train, text
    assert sum("status: interrupted  (" in x for x in lines) == 1  # each line once
    (step,) = [x for x in lines if "step 1/3: train/loss" in x]  # the file's own lines
    assert "step 1/3: train/loss" not in out and "memlab run in " in text
    assert lines.index(step) < lines.index(train)  # in the order they were said


def test_a_second_stop_kills_the_job_and_its_record_names_the_signal_received(tmp_path):
    """Ctrl-C twice: the job (waiting at its summary write, where stop signals are held) is
    killed; its record says SIGINT, twice, not "interrupted by SIGKILL". The running sweep holds
    its dir: a second sweep there is refused."""
    sweep, rel = tmp_path / "sweep", tmp_path / "rel"

    def stop_twice(proc, log):
        wait_for_marker(rel / "held", "summary", proc, log)
        assert app(["-m", *PINNED, f"hydra.sweep.dir={sweep}"]) == 2  # in use: refused
        proc.send_signal(signal.SIGINT)
        wait_for_text(log, "job #0: stopping it (SIGINT", proc)  # the first one reached it
        proc.send_signal(signal.SIGINT)

    code, out = _stopped_sweep(tmp_path, ["experiment=rel_held",
                                          "hydra.launcher.stop_grace_s=600"], stop_twice)
    assert code == 128 + signal.SIGINT, out[-3000:]
    assert "[memlab] sweep interrupted by SIGINT: 1 job: 1 interrupted" in out
    s = _summary(sweep / "0")
    assert s["status"] == "interrupted" and s["signal"] == "SIGINT", s["error"]
    assert s["error"].startswith("the sweep was interrupted by SIGINT while this job ran; "
                                 "killed with SIGKILL before it recorded its end (the sweep "
                                 "got SIGINT a second time)"), s["error"]
    assert s["overrides"][0] == "experiment=rel_held" and s["job"]["num"] == 0
    assert not (sweep / "1").exists()  # nothing of the refused sweep's


def test_a_sweep_dir_unwritable_from_the_start_moves_to_the_fallback(tmp_path, monkeypatch,
                                                                     capsys):
    (tmp_path / "a_file").write_text("a file where the sweep dir's parent would be")
    wanted = tmp_path / "a_file" / "sweep"
    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    assert app(["-m", "--config-dir", str(CONF), "experiment=rel_ok", *PINNED,
                f"hydra.sweep.dir={wanted}"]) == 0
    (moved,) = (tmp_path / "fallback").iterdir()
    s = _summary(moved / "0")
    assert s["status"] == "ok" and s["train"]["steps"] == 3, s["error"]
    assert f"could not use {wanted} (NotADirectoryError" in s["write_error"]
    assert s["job"]["sweep_dir"] == str(moved)
    out = capsys.readouterr().out
    assert f"[memlab] sweep finished: 1 job: 1 ok; summaries under {moved}" in out


# --------------------------------------------------------------------------------- memlab fit
FIT = ["--budget", "1GiB", "--steps", "3", "--measure", "1"]
ONE = [o for o in SMOKE if not o.startswith("train.steps=")] + [
    "train.gradient_checkpointing=true", "method.padding_free=false",
    "method.loss_impl=standard", "packing=none", "train.batch_size=2", "precision=fp32"]
"""One candidate: every dimension fit searches on the CPU is fixed by the command line."""


def _fit_stopped(tmp_path, monkeypatch, act) -> tuple[int, dict, dict]:
    """``memlab fit`` in this process; once its measured run is paused after step 1, ``act(pid
    of the run)``. The exit status, fit.json, the run's marker."""
    from memlab.cli.fit import main

    pause, out = tmp_path / "pause", tmp_path / "fit"
    pause_env(monkeypatch, pause, "step:1")
    seen: dict = {}

    def at_pause() -> None:
        seen.update(wait_for_marker(pause, "step:1"))
        act(seen["pid"])

    t = threading.Thread(target=at_pause, daemon=True)
    t.start()
    code = main([*FIT, "--out", str(out), *ONE])
    t.join(HANG_S)
    return code, json.loads((out / "fit.json").read_text()), seen


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_fit_stopped_stops_its_measured_run_and_writes_a_partial_fit_json(tmp_path, monkeypatch,
                                                                         capsys, sig):
    main_thread = threading.main_thread().ident
    code, record, run = _fit_stopped(tmp_path, monkeypatch,
                                     lambda pid: signal.pthread_kill(main_thread, sig))
    name = signal.Signals(sig).name
    assert code == 128 + sig
    assert record["status"] == "interrupted" and record["signal"] == name
    assert record["winner"] is None and record["nothing_fits"] is None
    (cand,) = record["candidates"]
    m = cand["measured"]  # the run recorded what it measured when fit stopped it
    assert m["status"] == "interrupted" and len(m["loss_curve"]) == 1 and m["peak_bytes"] > 0
    assert _gone(run["pid"])  # no orphan left measuring
    s = check_record(Path(m["run_dir"]) / "summary.json")
    assert s["status"] == "interrupted" and s["signal"] == "SIGTERM"  # what fit sent it
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    assert f"interrupted: stopped by {name}" in out.out and "no verdict" in out.out


def test_fit_never_takes_an_interrupted_measurement_for_a_verdict(tmp_path, monkeypatch,
                                                                  capsys):
    """A measured run killed from outside gives no verdict. (Fit's door of the shared directory,
    a second search refused while one holds ``--out``: test_fit.py's SIGTERM test.)"""
    code, record, run = _fit_stopped(tmp_path, monkeypatch,
                                     lambda pid: os.kill(pid, signal.SIGTERM))
    assert code == 128 + signal.SIGTERM
    assert record["status"] == "interrupted" and record["nothing_fits"] is None
    assert "was interrupted from outside" in record["interrupted"]
    assert record["winner"] is None
    out = capsys.readouterr().out
    assert "nothing fits" not in out and "over by" not in out
