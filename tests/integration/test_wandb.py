"""A real sweep with `logger=wandb` (offline), read back from W&B's own files: each run's summary
is its summary.json flattened, the two jobs share one group and differ in name and tags although
they differ only in `train.gradient_checkpointing`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memlab_testing import FAST, REPO

pytestmark = pytest.mark.integration
pytest.importorskip("wandb")

from memlab.measure.summary import flatten  # noqa: E402
from wandb_offline import read_run, run_file  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("wandb") / "multirun" / "2026-11-23" / "14-03-22"
    r = subprocess.run([sys.executable, "-m", "memlab", "-m", *FAST, "logger=wandb",
                        "train.gradient_checkpointing=true,false", f"hydra.sweep.dir={sweep}"],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return sweep


def test_wandb_summary_group_names_tags(sweep):
    runs = []
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "ok", summary["error"]
        got = read_run(run_file(sweep / job))
        flat = flatten(summary)
        assert len(flat) > 60
        diff = {k: (got["summary"].get(k, "<absent>"), v) for k, v in flat.items()
                if got["summary"].get(k, "<absent>") != v}
        assert not diff, diff
        runs.append(got["run"])
    assert runs[0].run_group == runs[1].run_group == "2026-11-23_14-03-22"
    assert [r.display_name for r in runs] == ["gradient_checkpointing=true",
                                              "gradient_checkpointing=false"]
    assert "train.gradient_checkpointing:true" in runs[0].tags
    assert "train.gradient_checkpointing:false" in runs[1].tags
    assert "peft:none" in runs[0].tags


def test_wandb_history_has_the_memory_of_tracked_steps(sweep):
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    rows = [r for r in read_run(run_file(sweep / "0"))["history"] if "train/loss" in r]
    got = {r["_step"] - 1: r["memory/step_peak_bytes"] for r in rows
           if "memory/step_peak_bytes" in r}
    tracked = summary["memory"]["tracked_steps"]
    assert sorted(got) == tracked
    assert got == dict(zip(tracked, summary["memory"]["tracked_step_peaks"]))
    assert max(got.values()) == summary["memory"]["peak_bytes"]
