"""A running job is not taken for a dead one (issue 43, live runs): ``memlab report`` on a sweep
whose job is still running shows it ``running`` (not ``missing``, "the job died"), and
``train.resume_from=latest`` passes over the checkpoints of a run that is still running (it
would prune them under the resumed run), saying so, and says which checkpoint it took."""

from __future__ import annotations

import pytest

from memlab.cli.report.load import load_summaries
from memlab_testing import run_job
from reliability.helpers import SMOKE, memlab_popen, release, wait_for_marker

pytestmark = pytest.mark.integration


def test_a_running_job_is_running_and_latest_skips_its_checkpoints(tmp_path, capfd):
    pause, log, sweep = tmp_path / "pause", tmp_path / "sweep.log", tmp_path / "sweep"
    train = [*SMOKE, "train.steps=3", "train.save_every=1", "precision=fp32"]
    proc = memlab_popen(["-m", *train, f"hydra.sweep.dir={sweep}"], log,
                        env={"MEMLAB_PAUSE_AT": "step:2", "MEMLAB_PAUSE_DIR": str(pause)})
    try:
        wait_for_marker(pause, "step:2", proc, log)
        (job,) = load_summaries([sweep])
        assert job["status"] == "running", job
        assert job["error"].startswith("running (pid ")
        live = run_job(tmp_path, [*train, "train.resume_from=latest",
                                  f"train.resume_root={sweep}"], fast=False, name="early")
        assert live["status"] == "invalid", live["error"]
        assert "its run is still running (pid" in live["error"]
        release(pause, "step:2")
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    (job,) = load_summaries([sweep])
    assert job["status"] == "ok"
    capfd.readouterr()
    done = run_job(tmp_path, [*SMOKE, "train.steps=4", "train.save_every=1", "precision=fp32",
                              "train.resume_from=latest", f"train.resume_root={sweep}",
                              "train.resume_allow=[train.steps]"], fast=False, name="after")
    assert done["status"] == "ok", done["error"]
    assert done["resume"]["step"] == 3
    assert f"train.resume_from=latest: resuming {sweep}/0/checkpoints/step_000003 (step 3)" in (
        capfd.readouterr().err)
