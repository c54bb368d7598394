"""`logger=tensorboard`: a run's event files, read back with TensorBoard's own reader
(``EventAccumulator``), hold the keys W&B gets - per step ``train/``, ``throughput/``,
``memory/step_peak_bytes`` on tracked steps, ``eval/`` at evaluations, the samples as a text; at
the end summary.json's measurements - with summary.json's values, byte counts exact."""

from __future__ import annotations

import pytest

from memlab_testing import run_job

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)
from tensorboard.util.tensor_util import make_ndarray  # noqa: E402

from memlab.measure.summary import LOGGED_PREFIXES, logged_summary  # noqa: E402


def _read(log_dir) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[str]]]:
    """``({scalar tag: [(step, value)]}, {text tag: [text]})`` of the event files in
    ``log_dir``."""
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    scalars, texts = {}, {}
    for tag in acc.Tags()["tensors"]:
        events = acc.Tensors(tag)
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        if plugin == "scalars":
            scalars[tag] = [(e.step, make_ndarray(e.tensor_proto).item()) for e in events]
        elif plugin == "text":
            texts[tag.removesuffix("/text_summary")] = [
                make_ndarray(e.tensor_proto).item().decode() for e in events]
    return scalars, texts


@pytest.mark.pipeline
def test_tensorboard_events_hold_summary_json(tmp_path):
    summary = run_job(tmp_path, ["logger=tensorboard", "data.eval=0.25", "train.eval_every=2",
                                 "train.eval_samples=1", "train.eval_max_new_tokens=4",
                                 "measure.memory_steps=2"])
    assert summary["status"] == "ok", summary["error"]
    log_dir = tmp_path / "run" / "tensorboard"
    assert summary["logger"] == {"option": "tensorboard", "dir": str(log_dir)}
    scalars, texts = _read(log_dir)

    train = summary["train"]
    assert scalars["train/loss"] == list(enumerate(train["loss_curve"], start=1))
    # one point a step: the run's tokens_per_s (summary.json's) adds none at the last step
    assert [s for s, _ in scalars["throughput/tokens_per_s"]] == [1, 2, 3]
    memory = summary["memory"]
    assert scalars["memory/step_peak_bytes"] == [
        (s + 1, float(p)) for s, p in zip(memory["tracked_steps"], memory["tracked_step_peaks"])]
    history = summary["eval"]["history"]
    assert scalars["eval/loss"] == [(h["step"], h["loss"]) for h in history]

    # at the end: every numeric measurement, at the last step, exact (double precision)
    final = {k: v for k, v in logged_summary(summary).items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)
             and not k.startswith("meta/") and k not in ("throughput/tokens_per_s",
                                                         "data/padding_fraction")}
    assert {"memory/peak_bytes", "memory/by_category/activations", "train/final_loss",
            "eval/final/loss", "wall_time_s"} <= set(final)
    for key, value in final.items():
        assert scalars[key] == [(3, float(value))], key
    assert {k.split("/", 1)[0] for k in scalars} <= set(LOGGED_PREFIXES) - {"meta"}

    sample = summary["eval"]["samples"][-1]
    assert sample["prompt"].splitlines()[0][:20] in texts["eval/samples"][-1]
    assert "| status | ok |" in texts["summary"][0]
    assert "| meta/device/type | cpu |" in texts["summary"][0]
    assert '"peft"' in texts["config"][0] and '"name": "none"' in texts["config"][0]


def test_byte_counts_stay_exact(tmp_path):
    """A peak of 80 GiB + 1 byte reads back as it was (float32 would round it by 4 KiB)."""
    from memlab.logger.base import RunInfo
    from memlab.logger.tensorboard import TensorboardLogger

    run = TensorboardLogger().start(RunInfo(tmp_path), {})
    run.log({"memory/step_peak_bytes": 80 * 2**30 + 1, "train/loss": 1.5}, step=1)
    run.finish({"status": "ok", "error": None, "memory": {"peak_bytes": 80 * 2**30 + 3},
                "device": {"type": "cpu"}})
    scalars, texts = _read(tmp_path / "tensorboard")
    assert scalars == {"memory/step_peak_bytes": [(1, 80 * 2**30 + 1)], "train/loss": [(1, 1.5)],
                       "memory/peak_bytes": [(1, 80 * 2**30 + 3)]}
    assert "| meta/device/type | cpu |" in texts["summary"][0]
