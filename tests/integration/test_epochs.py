"""``train.epochs`` trains whole passes over the rows (issue 46 item 10): the steps a pass comes
to (``ceil(rows / (batch_size * processes * grad_accum))``, transformers' count: a partial last
micro-batch, a short last step), every row trained on once a pass (the tokens trained are the
prepared data's), rows after packing, an online method's prompts, a resume inside a pass;
summary.json records them. Counting, and N processes as one with N times the batch:
tests/unit/core/test_epochs.py (a DDP run of 2 x 1 rows takes 16 s here: it was checked by hand
to take the 6 steps of 1 x 2)."""

from __future__ import annotations

import math

from memlab_testing import FAST, run_job

BASE = [o for o in FAST if not o.startswith("train.steps=")] + [
    "train.steps=null", "measure.memory_steps=0", "data.n_examples=21", "train.batch_size=2",
    "train.grad_accum=2"]
"""21 rows in micro-batches of 2 and steps of 2: 11 micro-batches a pass (the last of one row),
6 steps (the last of one micro-batch)."""


def _kept(s: dict) -> int:
    """The tokens of the prepared rows (what one pass trains on)."""
    return s["data"]["tokens_in"] - s["data"]["tokens_dropped"]


def test_epochs_train_every_row_once_a_pass_end_the_schedule_and_resume(tmp_path):
    s = run_job(tmp_path, [*BASE, "train.epochs=2", "train.save_every=5"], fast=False)
    assert s["status"] == "ok", s["error"]
    per = math.ceil(21 / (2 * 2))
    t = s["train"]
    assert (t["steps"], t["steps_planned"], t["epochs"], t["steps_per_epoch"]) == (
        2 * per, 2 * per, 2, per)
    # a step drawing grad_accum micro-batches across the pass's end would train 24 micro-batches
    assert s["data"]["tokens_trained"] == 2 * _kept(s)
    assert t["final_metrics"]["train/lr"] == 0.0  # the cosine schedule ends at the last step
    assert s["config"]["train"]["epochs"] == 2 and s["config"]["train"]["steps"] is None
    # resumed in the first pass's last step, the run continues as the straight one
    step5 = f"{s['run_dir']}/checkpoints/step_000005"
    r = run_job(tmp_path, [*BASE, "train.epochs=2", f"train.resume_from={step5}"], fast=False,
                name="resumed")
    assert r["status"] == "ok", r["error"]
    assert r["train"]["steps"] == 2 * per and r["train"]["loss_curve"] == t["loss_curve"]


def test_with_packing_a_pass_is_over_the_packed_rows(tmp_path):
    s = run_job(tmp_path, [*BASE, "train.epochs=1", "packing=bfd", "data.median_tokens=30"],
                fast=False)
    assert s["status"] == "ok", s["error"]
    rows = s["data"]["rows"]
    assert rows < s["data"]["examples"]  # packed: several examples a row
    assert s["train"]["steps"] == s["train"]["steps_per_epoch"] == math.ceil(rows / 4)
    assert s["data"]["tokens_trained"] == _kept(s)


def test_an_online_method_counts_prompts(tmp_path):
    over = [o for o in BASE if not o.startswith("method.max_length")]
    s = run_job(tmp_path, [*over, "train.epochs=1", "data.n_examples=7", "method=grpo",
                           "method.max_prompt_length=32", "method.max_completion_length=4"],
                fast=False)
    assert s["status"] == "ok", s["error"]
    assert s["train"]["steps"] == math.ceil(7 / 4) == 2
    assert s["data"]["groups"] == 7  # one reward group per prompt: every prompt once


def test_the_estimate_knows_the_steps_from_data_and_says_when_it_cannot(tmp_path):
    import json

    from memlab.cli.estimate import main as estimate_main

    notes = {}
    for mode in ("worst", "--from-data"):
        out = tmp_path / mode.strip("-")
        assert estimate_main([*BASE, "train.epochs=2", *([mode] if mode != "worst" else []),
                              "--out", str(out)]) == 0
        est = json.loads((out / "estimate.json").read_text())
        assert est["status"] == "ok", est["error"]
        notes[mode] = [n for n in est["assumptions"] if n.startswith("train.epochs=2")]
    assert notes["--from-data"] == ["train.epochs=2: 6 step(s) a pass over the prepared rows, "
                                    "12 in all"], notes
    assert len(notes["worst"]) == 1 and "--from-data counts them" in notes["worst"][0], notes
