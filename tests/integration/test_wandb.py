"""A real sweep with `logger=wandb` (offline), read back from W&B's own files, as its users set
it up (WANDB_PROJECT / WANDB_TAGS in the environment, W&B's own output on): each run's summary
is its summary.json's measurements (the config stays in the config), the jobs share one group and
differ in name and tags, the evaluations are in the history (samples as a table). An invalid job
is a run too: tests/unit/logger/test_wandb.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memlab_testing import FAST, REPO

pytestmark = pytest.mark.integration
pytest.importorskip("wandb")

from memlab.logger.wandb import measurements  # noqa: E402
from wandb_offline import read_run, run_file  # noqa: E402

ENV = {**{k: v for k, v in os.environ.items() if k != "WANDB_SILENT"},
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_PROJECT": "users-project",
       "WANDB_TAGS": "mine,ours"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("wandb") / "multirun" / "2026-11-23" / "14-03-22"
    r = subprocess.run([sys.executable, "-m", "memlab", "-m", *FAST, "logger=wandb",
                        "data.eval=0.25", "train.eval_every=2", "train.eval_samples=1",
                        "train.eval_max_new_tokens=4", "train.checkpoint_every=1,2",
                        f"hydra.sweep.dir={sweep}"],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return sweep, r.stdout + r.stderr


def test_wandb_summary_group_names_tags(sweep):
    sweep, _ = sweep
    runs = []
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "ok", summary["error"]
        got = read_run(run_file(sweep / job))
        flat = measurements(summary)
        assert 60 < len(flat) < 160 and not any(k.startswith(("config/", "choices/"))
                                                 for k in got["summary"])
        diff = {k: (got["summary"].get(k, "<absent>"), v) for k, v in flat.items()
                if got["summary"].get(k, "<absent>") != v}
        assert not diff, diff
        config = {i.key: json.loads(i.value_json) for i in got["run"].config.update}
        assert config["train"]["checkpoint_every"] == int(job) + 1
        runs.append(got["run"])
        assert summary["logger"]["sources"]["project"] == "env WANDB_PROJECT"
    assert runs[0].run_group == runs[1].run_group == "2026-11-23_14-03-22"
    assert runs[0].project == "users-project"
    assert [r.display_name for r in runs] == ["checkpoint_every=1", "checkpoint_every=2"]
    assert {"mine", "ours", "train.checkpoint_every:1", "peft:none"} <= set(runs[0].tags)


def test_wandb_output_is_shown(sweep):
    _, output = sweep
    assert "wandb sync " in output  # the offline run's sync hint
    assert "Run history:" not in output  # the per-step panel stays off


def test_wandb_history_has_the_evaluations(sweep):
    sweep, _ = sweep
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    history = read_run(run_file(sweep / "0"))["history"]
    evals = [(r["_step"], r["eval/loss"]) for r in history if "eval/loss" in r]
    assert evals == [(h["step"], h["loss"]) for h in summary["eval"]["history"]]
    assert [h["step"] for h in summary["eval"]["history"]] == [2, 3]
    tables = [r["eval/samples/path"] for r in history
              if r.get("eval/samples/_type") == "table-file"]
    assert len(tables) == 2
    files = run_file(sweep / "0").parent / "files"
    table = json.loads((files / tables[-1]).read_text())
    sample = summary["eval"]["samples"][-1]
    assert table["columns"] == ["step", "prompt", "completion"]
    assert table["data"] == [[3, sample["prompt"], sample["completion"]]]


def test_wandb_history_has_the_memory_of_tracked_steps(sweep):
    sweep, _ = sweep
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    rows = [r for r in read_run(run_file(sweep / "0"))["history"] if "train/loss" in r]
    got = {r["_step"] - 1: r["memory/step_peak_bytes"] for r in rows
           if "memory/step_peak_bytes" in r}
    tracked = summary["memory"]["tracked_steps"]
    assert sorted(got) == tracked
    assert got == dict(zip(tracked, summary["memory"]["tracked_step_peaks"]))
    assert max(got.values()) == summary["memory"]["peak_bytes"]
