"""Every way one run can end leaves a summary.json with a precise status and all it measured so
far (in-process runs: each is paused at an explicit hook, hit, then released; no sleeps).

Stop signals (SIGTERM, SIGINT, SIGHUP) at four points (data preparation, a training step, a checkpoint write, the summary
write), a non-finite loss, an injected crash, an unwritable run dir, checkpoints that cannot be
written (save_every, save_final)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from memlab.faults import FAULT_AT
from memlab.measure.outcome import Interrupted
from memlab.measure.summary import FALLBACK_ENV
from memlab.record import exit_code
from memlab_testing import run_job
from reliability.helpers import SMOKE, AtPause, pause_env, signal_main_thread

pytestmark = pytest.mark.integration


def _on_disk(run_dir: Path) -> dict:
    """The summary as written (strict JSON: a NaN would fail here)."""
    def no_constants(name):
        raise AssertionError(f"summary.json holds {name}")

    return json.loads((run_dir / "summary.json").read_text(), parse_constant=no_constants)


def _stopped_at(tmp_path, monkeypatch, point: str, sig: int, extra: list[str] = ()) -> dict:
    pause_env(monkeypatch, tmp_path / "pause", point)
    hit = AtPause(tmp_path / "pause", point, signal_main_thread(sig))
    hit.start()
    summary = run_job(tmp_path, [*SMOKE, *extra], fast=False)
    hit.join()
    assert _on_disk(tmp_path / "run") == json.loads(json.dumps(summary))
    return summary


def test_sigterm_during_data_preparation(tmp_path, monkeypatch):
    s = _stopped_at(tmp_path, monkeypatch, "data", signal.SIGTERM)
    assert s["status"] == "interrupted" and s["signal"] == "SIGTERM", s["error"]
    assert "before training started" in s["error"]
    assert s["train"] is None and s["memory"] is None  # nothing was measured yet


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_during_training_keeps_the_steps_done(tmp_path, monkeypatch, sig):
    s = _stopped_at(tmp_path, monkeypatch, "step:2", sig)
    name = signal.Signals(sig).name
    assert s["status"] == "interrupted" and s["signal"] == name, s["error"]
    assert s["error"] == f"interrupted by {name} after 2 step(s)"
    t = s["train"]
    assert t["steps"] == 2 and t["steps_planned"] == 3 and len(t["loss_curve"]) == 2
    assert all(x > 0 for x in t["loss_curve"])
    assert s["memory"]["peak_bytes"] > 0
    assert s["memory"]["by_phase_category"]["forward"]["activations"] > 0
    assert s["throughput"]["tokens_per_s"] > 0  # step 2 was timed (step 1 tracked)
    assert s["data"]["tokens_trained"] > 0 and s["data"]["examples"] == 16
    assert exit_code(s) == 128 + sig  # 129 for a hang-up (the terminal closed)


def test_sigterm_during_a_checkpoint_write(tmp_path, monkeypatch):
    s = _stopped_at(tmp_path, monkeypatch, "checkpoint", signal.SIGTERM,
                    ["train.save_every=2"])
    assert s["status"] == "interrupted" and s["train"]["steps"] == 2, s["error"]
    assert not (tmp_path / "run" / "checkpoints" / "step_000002").exists()


def test_sigterm_during_the_summary_write_is_honoured_after_it(tmp_path, monkeypatch, capsys):
    pause_env(monkeypatch, tmp_path / "pause", "summary")
    hit = AtPause(tmp_path / "pause", "summary", signal_main_thread(signal.SIGTERM))
    hit.start()
    with pytest.raises(Interrupted) as stopped:  # held while the record was written
        run_job(tmp_path, SMOKE, fast=False, print_table=True)
    hit.join()
    assert stopped.value.signal == "SIGTERM" and stopped.value.exit_code == 143
    s = _on_disk(tmp_path / "run")
    assert s["status"] == "ok" and s["train"]["steps"] == 3  # the run had ended: complete
    assert "status: ok" in capsys.readouterr().out  # and its table was printed


def test_nan_loss_records_the_step_and_the_curve_before_it(tmp_path):
    s = run_job(tmp_path, [*SMOKE, "train.lr=1e30", "train.max_grad_norm=null"], fast=False)
    assert s["status"] == "nan", s["error"]
    t = s["train"]
    assert t["nan_step"] == t["steps"] == len(t["loss_curve"]) >= 2
    assert t["loss_curve"][-1] is None and t["loss_curve"][0] > 0
    assert f"at step {t['nan_step']}" in s["error"]
    _on_disk(tmp_path / "run")  # strict JSON


def test_a_crash_keeps_what_was_measured(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_AT, "step:2")
    s = run_job(tmp_path, SMOKE, fast=False)
    assert s["status"] == "failed" and "fault injected at step:2" in s["error"]
    assert s["train"]["steps"] == 2 and s["memory"]["peak_bytes"] > 0
    assert "InjectedFault" in (tmp_path / "run" / "error.txt").read_text()


def _make_unwritable(run_dir: Path):
    """The run dir is replaced by a file (unwritable for root too)."""
    def action():
        os.replace(run_dir, run_dir.with_name("run.moved"))
        run_dir.write_text("not a directory")

    return action


def test_unwritable_run_dir_summary_goes_to_the_named_fallback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    pause_env(monkeypatch, tmp_path / "pause", "step:2")
    hit = AtPause(tmp_path / "pause", "step:2", _make_unwritable(tmp_path / "run"))
    hit.start()
    s = run_job(tmp_path, SMOKE, fast=False, print_table=True)
    hit.join()
    assert s["status"] == "ok" and s["train"]["steps"] == 3, s["error"]
    written = list((tmp_path / "fallback").iterdir())
    assert len(written) == 1 and str(written[0]) in s["write_error"]
    assert str(tmp_path / "run" / "summary.json") in s["write_error"]
    assert json.loads(written[0].read_text())["train"] == s["train"]
    out = capsys.readouterr()
    assert "status: ok" in out.out and str(written[0]) in out.out  # the table names it
    assert str(written[0]) in out.err  # and so does the error line


def test_unwritable_run_dir_final_checkpoint_failure_beside_the_results(tmp_path, monkeypatch):
    monkeypatch.setenv(FALLBACK_ENV, str(tmp_path / "fallback"))
    pause_env(monkeypatch, tmp_path / "pause", "step:2")
    hit = AtPause(tmp_path / "pause", "step:2", _make_unwritable(tmp_path / "run"))
    hit.start()
    s = run_job(tmp_path, [*SMOKE, "train.save_final=true"], fast=False)
    hit.join()
    assert s["status"] == "failed" and "checkpoint not written" in s["error"], s["error"]
    assert s["checkpoint"]["errors"] and s["checkpoint"]["errors"][0].startswith("step 3:")
    assert s["train"]["steps"] == 3 and len(s["train"]["loss_curve"]) == 3
    assert s["throughput"]["tokens_per_s"] > 0 and s["memory"]["peak_bytes"] > 0
    assert len(list((tmp_path / "fallback").iterdir())) == 1


def test_periodic_checkpoint_failure_training_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("a file where the checkpoints would go")
    s = run_job(tmp_path, [*SMOKE, "train.save_every=2"], fast=False)
    assert s["status"] == "failed" and "checkpoint not written" in s["error"], s["error"]
    assert s["train"]["steps"] == 3  # trained on after the failed save at step 2
    assert [e.split(":")[0] for e in s["checkpoint"]["errors"]] == ["step 2"]
    assert _on_disk(run_dir)["status"] == "failed"
