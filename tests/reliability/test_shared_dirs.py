"""Runs never overwrite or lose each other (:mod:`memlab.rundir`): a run dir in use is refused
to a second job before it writes anything; time-stamped dirs are new for every run, even two
started in the same second, and ``resume_from=latest`` still finds the newest checkpoint; a run
into a used dir prunes only its own checkpoints and names its own; no write follows a link out of
the run dir; a run dir that cannot be written from the start moves to the fallback dir, named in
the record.

Runs go through memlab's Hydra app in this process (:func:`app`) or, where one must hold its dir
while another starts, in a subprocess paused at a fault hook (no sleeps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from memlab.faults import FAULT_AT
from memlab.measure.summary import FALLBACK_ENV
from memlab_testing import CONF, app, run_job
from reliability.helpers import (
    HANG_S,
    SMOKE,
    memlab_popen,
    release,
    wait_for_marker,
)

pytestmark = pytest.mark.integration

QUIET = [*SMOKE, "train.progress=false"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_second_job_in_a_run_dir_in_use_is_refused_before_it_writes(tmp_path, capsys):
    run_dir, pause, log = tmp_path / "run", tmp_path / "pause", tmp_path / "first.log"
    first = memlab_popen([*QUIET, "train.seed=1", f"hydra.run.dir={run_dir}"], log,
                         env={"MEMLAB_PAUSE_AT": "step:1", "MEMLAB_PAUSE_DIR": str(pause)})
    try:
        holder = wait_for_marker(pause, "step:1", first, log)
        hydra_files = {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()}
        assert app([*QUIET, "train.seed=2", f"hydra.run.dir={run_dir}"]) == 2
        err = capsys.readouterr().err
        assert f"hydra.run.dir={run_dir} is in use by another memlab job" in err, err
        assert f"pid {holder['pid']}" in err and "train.seed=1" in err
        # nothing of the second job's: the first's files as they were
        assert {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()} == hydra_files
        assert not (run_dir / "summary.json").exists()
        release(pause, "step:1")
        assert first.wait(timeout=HANG_S) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    s = _summary(run_dir)
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    assert s["status"] == "ok" and s["overrides"] == overrides and "train.seed=1" in overrides


def test_runs_in_the_same_second_get_their_own_dirs_and_latest_finds_the_newest(tmp_path):
    """``${now:%Y}``: every run of this year lands in the same second's name, as two runs of the
    default ``outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}`` started in the same second do."""
    default = yaml.safe_load((CONF / "config.yaml").read_text())["hydra"]
    assert "${now:" in default["run"]["dir"] and "${now:" in default["sweep"]["dir"]
    stamped = f"hydra.run.dir={tmp_path}/out/${{now:%Y}}"
    for seed in (1, 2):
        assert app([*QUIET, f"train.seed={seed}", "train.save_final=true", stamped]) == 0
    year = sorted((tmp_path / "out").iterdir())
    assert [p.name.partition("_")[2] for p in year] == ["", "1"]
    first, second = (_summary(p) for p in year)
    assert "train.seed=1" in first["overrides"] and "train.seed=2" in second["overrides"]
    assert first["train"]["checkpoint"].startswith(str(year[0]))
    assert second["train"]["checkpoint"].startswith(str(year[1]))
    assert app([*QUIET, "train.seed=2", "train.steps=4", "train.resume_from=latest",
                "train.resume_allow=[train.steps]", stamped]) == 0
    resumed = _summary(sorted((tmp_path / "out").iterdir())[-1])
    assert resumed["resume"]["from"] == second["train"]["checkpoint"]
    assert resumed["train"]["steps"] == 4


def test_a_rerun_into_a_used_dir_prunes_only_its_own_checkpoints(tmp_path):
    keep = ["train.save_every=1", "train.keep_last=1"]
    old = run_job(tmp_path, [*QUIET, *keep, "train.steps=4"], fast=False)
    assert [Path(old["train"]["checkpoint"]).name] == ["step_000004"]
    new = run_job(tmp_path, [*QUIET, *keep, "train.steps=2", "train.seed=5"], fast=False)
    assert new["status"] == "ok", new["error"]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert new["train"]["checkpoint"] == str(checkpoints / "step_000002")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000004"]
    state = json.loads((checkpoints / "step_000002" / "memlab_state.json").read_text())
    assert state["step"] == 2 and state["config"]["train"]["seed"] == 5


def test_no_write_follows_a_link_planted_in_the_run_dir(tmp_path, monkeypatch):
    """error.txt, summary.json, the profile's files, Hydra's .hydra/*.yaml and memlab.log: each
    replaces a link planted at its name, the file the link names stays as it was."""
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    names = ["error.txt", "summary.json", "memlab.log", ".hydra/overrides.yaml",
             ".hydra/config.yaml", "profile/ops.txt", "profile/summary.json"]
    for i, name in enumerate(names):
        (outside / str(i)).write_text("precious")
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).symlink_to(outside / str(i))
    monkeypatch.setenv(FAULT_AT, "step:2")  # after the profiled step
    assert app([*QUIET, "measure.profile_step=1", f"hydra.run.dir={run_dir}"]) == 1
    assert all((outside / str(i)).read_text() == "precious" for i in range(len(names)))
    for name in names:
        assert not (run_dir / name).is_symlink() and (run_dir / name).is_file(), name
    assert "InjectedFault" in (run_dir / "error.txt").read_text()
    assert _summary(run_dir)["status"] == "failed"
    assert json.loads((run_dir / "profile" / "summary.json").read_text())["wall_s"] > 0


def test_fits_run_log_replaces_a_link_planted_at_its_name(tmp_path):
    """Sibling through fit's door: a measured run's console, ``runs/<i>.log`` in a reused
    ``--out``, replaces a link planted there (before, ``open(log, "wb")`` followed it out)."""
    from memlab.cli.fit.search import run_log, run_once

    outside, run_dir = tmp_path / "precious.txt", tmp_path / "out" / "runs" / "0"
    outside.write_text("precious")
    run_dir.parent.mkdir(parents=True)
    run_log(run_dir).symlink_to(outside)
    got = run_once(["debug=smok"], 1, run_dir)  # refused at once: exit 2, no summary
    assert got["status"] == "failed" and "debug=smok: no such option" in got["error"], got
    assert outside.read_text() == "precious"
    assert not run_log(run_dir).is_symlink()
    assert "did you mean debug=smoke?" in run_log(run_dir).read_text()


def test_a_run_dir_unwritable_from_the_start_moves_to_the_fallback(tmp_path, monkeypatch,
                                                                   capsys):
    (tmp_path / "a_file").write_text("a file where the run dir's parent would be")
    wanted = tmp_path / "a_file" / "run"
    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    assert app([*QUIET, f"hydra.run.dir={wanted}"]) == 0
    (moved,) = (tmp_path / "fallback").iterdir()
    s = _summary(moved)
    assert s["status"] == "ok" and s["train"]["steps"] == 3, s["error"]
    assert s["run_dir"] == str(moved)
    assert f"could not use {wanted} (NotADirectoryError" in s["write_error"]
    assert str(moved) in s["write_error"]
    out = capsys.readouterr()
    assert str(moved) in out.err and f"summary: could not use {wanted}" in out.out


def test_a_stray_pause_hook_is_refused_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAB_PAUSE_AT", "step:1")
    monkeypatch.delenv("MEMLAB_PAUSE_DIR", raising=False)
    s = run_job(tmp_path, QUIET, fast=False)
    assert s["status"] == "invalid" and s["memory"] is None, s["error"]
    assert "MEMLAB_PAUSE_AT=step:1 is set without MEMLAB_PAUSE_DIR" in s["error"]
    assert "the run would wait forever" in s["error"]

