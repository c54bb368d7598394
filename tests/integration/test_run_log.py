"""A run's memlab.log holds its log (issue 46): the composed choices, the data's counts, one line
per logging interval, the evaluations and the final table (warnings: tests/unit/measure/test_runlog.py); the console shows each of
its own lines once and leaves the per-step lines to the file (the bar shows them)."""

from __future__ import annotations

import pytest

from memlab_testing import app
from reliability.helpers import SMOKE

pytestmark = pytest.mark.integration


def test_a_runs_log_holds_choices_data_intervals_evals_warnings_and_the_table(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = app([*SMOKE, "train.progress=false", "precision=fp32", "train.log_every=2",
                "data.eval=0.25", "train.eval_every=2", f"hydra.run.dir={run_dir}"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    log = (run_dir / "memlab.log").read_text()
    lines = log.splitlines()

    def at(text: str) -> int:
        (i,) = [i for i, line in enumerate(lines) if text in line]
        return i

    order = [at(f"memlab run in {run_dir}: debug=smoke"), at("] data: examples 12, rows 12"),
             at("] held-out data: examples 4"), at("step 2/3: train/loss"),
             at("eval at step 2/3: eval/loss"), at("step 3/3: train/loss"),
             at("eval at step 3/3: eval/loss"), at("status: ok")]
    assert order == sorted(order), log
    assert "step 1/3" not in log  # one line a logging interval (train.log_every=2)
    assert "peak memory (tracker, cpu)" in log and "train: 3 steps, final loss" in log
    console = out + err
    assert "step 2/3: train/loss" not in console and "eval at step 2/3: eval/loss" in out
    assert console.count("status: ok") == 1 and console.count("eval at step 3/3") == 1


def test_a_distributed_runs_log_holds_the_lines_of_its_training(tmp_path, capsys):
    """Two DDP ranks train: their data counts and interval lines are in the run's memlab.log
    too (rank 0 appends there beside the run's process), with the run's choices and table."""
    run_dir = tmp_path / "run"
    code = app([*SMOKE, "train.progress=false", "precision=fp32", "train.log_every=1",
                "distributed=ddp", "distributed.nproc=2", f"hydra.run.dir={run_dir}"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    log = (run_dir / "memlab.log").read_text()
    for text in (f"memlab run in {run_dir}", "] data: examples", "step 1/3: train/loss",
                 "step 3/3: train/loss", "status: ok"):
        assert log.count(text) == 1, (text, log)
