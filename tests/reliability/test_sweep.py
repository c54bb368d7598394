"""A sweep through memlab's launcher records every job with its true status, whatever happens to
it: ok, oom (RLIMIT_AS), invalid, failed (a crash), killed (SIGKILL from outside), timeout (the
launcher's limit), interrupted (SIGTERM to the sweep) and not_run (after the interruption); the
report lists all of them; the sweep ends with one line and the right exit status.

The jobs come from ``tests/reliability/conf/experiment/rel_*.yaml`` (``--config-dir``): each sets
its own launcher environment (memlab's fault hooks) or limits. The test acts only once a job is
paused at its marker, so nothing depends on timing."""

from __future__ import annotations

import csv
import json
import os
import signal
from pathlib import Path

import pytest

from memlab.cli.report import main as report
from memlab.measure.summary import fallback_name
from memlab_testing import check_record
from reliability.helpers import limited_python, memlab_popen, wait_for_marker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONF = Path(__file__).parent / "conf"
JOBS = ["ok", "oom", "invalid", "failed", "killed", "timeout", "interrupted", "not_run"]
SWEEP_SMOKE = ["debug=smoke", "train.steps=2", "data.n_examples=16", "method.max_length=64",
               "measure.memory_steps=1", "measure.warmup_steps=0", "precision=fp32"]


def _statuses(sweep: Path, n: int) -> list[dict]:
    return [check_record(sweep / str(i) / "summary.json") for i in range(n)]


def test_full_sweep_every_job_has_its_true_status(tmp_path, capsys):
    sweep, rel, tmp = tmp_path / "sweep", tmp_path / "rel", tmp_path / "tmp"
    tmp.mkdir()
    log = tmp_path / "sweep.log"
    # a record planted (or left by an earlier run) where the killed job's fallback record would
    # go: the launcher must not take it for that job's (it lacks the job's record id)
    planted = tmp / "memlab-unsaved"
    planted.mkdir(mode=0o700)
    (planted / fallback_name(sweep / str(JOBS.index("killed")) / "summary.json")).write_text(
        json.dumps({"status": "ok", "error": None, "throughput": {"tokens_per_s": 999999},
                    "job": {"record_id": "planted"}}))
    proc = memlab_popen(
        ["-m", "--config-dir", str(CONF),
         "experiment=" + ",".join(f"rel_{j}" for j in JOBS), *SWEEP_SMOKE,
         "hydra.launcher.stop_grace_s=120", f"hydra.sweep.dir={sweep}"],
        log, env={"REL_DIR": str(rel), "TMPDIR": str(tmp),
                  "REL_PYTHON": str(limited_python(tmp_path))})  # the oom job's own python
    try:
        killed = wait_for_marker(rel / "killed", "step:1", proc, log)
        os.kill(killed["pid"], signal.SIGKILL)
        wait_for_marker(rel / "interrupted", "step:1", proc, log)
        proc.send_signal(signal.SIGTERM)  # to the sweep, not to the job
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert ("[memlab] sweep interrupted by SIGTERM: 8 jobs: 1 ok, 1 oom, 1 invalid, 1 failed, "
            "1 killed, 1 timeout, 1 interrupted, 1 not_run") in out, out[-3000:]
    assert not list(tmp.glob("memlab_launch_*")), "the launcher left its temp files"

    s = dict(zip(JOBS, _statuses(sweep, len(JOBS)), strict=True))
    assert {k: v["status"] for k, v in s.items()} == {j: j for j in JOBS}, {
        k: (v["status"], v["error"]) for k, v in s.items()}
    assert s["ok"]["train"]["steps"] == 2 and s["ok"]["error"] is None
    assert "can't allocate memory" in s["oom"]["error"]
    assert "train.lr" in s["invalid"]["error"]
    assert "fault injected at step:1" in s["failed"]["error"]
    assert s["failed"]["train"]["steps"] == 1 and s["failed"]["memory"]["peak_bytes"] > 0
    assert s["killed"]["signal"] == "SIGKILL" and "no sign of the out-of-memory killer" in (
        s["killed"]["error"])
    assert "recorded_status" not in s["killed"] and s["killed"]["throughput"] != {
        "tokens_per_s": 999999}  # the planted record was not merged
    assert s["timeout"]["error"].startswith("stopped by the launcher after timeout_min=0.02")
    assert s["interrupted"]["signal"] == "SIGTERM"
    assert s["interrupted"]["error"] == "interrupted by SIGTERM after 1 step(s)"
    assert s["interrupted"]["train"]["loss_curve"] and s["interrupted"]["memory"]["peak_bytes"]
    assert s["not_run"]["error"].startswith("not started: the sweep was interrupted by SIGTERM")
    assert s["not_run"]["overrides"][0] == "experiment=rel_not_run"
    assert [v["job"]["num"] for v in s.values()] == list(range(len(JOBS)))

    capsys.readouterr()
    assert report([str(sweep), "--out", str(tmp_path / "report"), "--no-plots"]) == 0
    printed = capsys.readouterr().out
    assert ("8 jobs: 1 ok, 1 oom, 1 invalid, 1 failed, 1 killed, 1 timeout, 1 interrupted, "
            "1 not_run") in printed
    rows = list(csv.DictReader((tmp_path / "report" / "report.csv").open()))
    got = {row["experiment"]: row["status"] for row in rows}
    assert got == {f"rel_{j}": j for j in JOBS}


def test_sweep_with_a_crash_exits_nonzero_and_one_without_exits_zero(tmp_path):
    """oom / invalid are results (exit 0); a crash is a bug (exit 1); both end with one line."""
    common = ["-m", "--config-dir", str(CONF), *SWEEP_SMOKE]
    crash_log, fine_log = tmp_path / "crash.log", tmp_path / "fine.log"
    crash = memlab_popen([*common, "experiment=rel_ok",  # it crashes when it reads the data
                          f"hydra.sweep.dir={tmp_path / 'crash'}"], crash_log,
                         env={"MEMLAB_FAULT_AT": "data"})
    assert crash.wait(timeout=600) == 1, crash_log.read_text()[-3000:]
    assert "[memlab] sweep finished: 1 job: 1 failed" in crash_log.read_text()
    fine = memlab_popen([*common, "experiment=rel_invalid,rel_oom",
                         f"hydra.sweep.dir={tmp_path / 'fine'}"], fine_log,
                        env={"REL_PYTHON": str(limited_python(tmp_path))})
    assert fine.wait(timeout=600) == 0, fine_log.read_text()[-3000:]
    assert "[memlab] sweep finished: 2 jobs: 1 oom, 1 invalid" in fine_log.read_text()
    assert json.loads((tmp_path / "crash" / "0" / "summary.json").read_text())["error"] == (
        "InjectedFault: fault injected at data (MEMLAB_FAULT_AT)")
