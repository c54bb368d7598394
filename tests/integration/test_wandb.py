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
from memlab.measure.summary import LOGGED_PREFIXES  # noqa: E402
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
        assert 60 < len(flat) < 160
        diff = {k: (got["summary"].get(k, "<absent>"), v) for k, v in flat.items()
                if got["summary"].get(k, "<absent>") != v}
        assert not diff, diff
        config = {i.key: json.loads(i.value_json) for i in got["run"].config.update}
        assert config["train"]["checkpoint_every"] == int(job) + 1
        assert config["peft"]["name"] == "none"  # each group choice: a config key, no tag
        runs.append(got["run"])
        assert summary["logger"]["sources"]["project"] == "env WANDB_PROJECT"
    assert runs[0].run_group == runs[1].run_group == "2026-11-23_14-03-22"
    assert runs[0].project == "users-project"
    assert [r.display_name for r in runs] == ["checkpoint_every=1", "checkpoint_every=2"]
    # the user's tags, then what the sweep varies; what every job shares is no tag
    assert [r.tags for r in runs] == [["mine", "ours", f"train.checkpoint_every:{n}"]
                                      for n in (1, 2)]


def test_wandb_summary_is_measurements_and_meta(sweep):
    """The run summary's top-level names are the measured sections and one ``meta/``; every
    string there (a source, a path, a note, a setting) is under ``meta/``, but for the three
    that are measurements (status, error, the phase of the peak) and the file W&B keeps the
    sample completions' table in."""
    sweep, _ = sweep
    got = read_run(run_file(sweep / "0"))["summary"]
    tops = {k.split("/", 1)[0] for k in got if not k.startswith("_")}
    assert tops <= set(LOGGED_PREFIXES), tops - set(LOGGED_PREFIXES)
    assert set(LOGGED_PREFIXES) == {"status", "error", "wall_time_s", "memory", "throughput",
                                    "data", "train", "eval", "profile", "meta"}
    words = sorted(k for k, v in got.items() if isinstance(v, str)  # eval/samples: W&B's table
                   and not k.startswith(("meta/", "_", "eval/samples/"))
                   and k not in ("status", "error", "memory/peak_at/phase"))
    assert not words, words
    for key in ("meta/logger/id", "meta/logger/sources/dir", "meta/device/type",
                "meta/eval/source", "meta/memory/source"):
        assert key in got, key
    assert not any(k.startswith(("logger/", "device/", "config/", "choices/")) for k in got)


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
