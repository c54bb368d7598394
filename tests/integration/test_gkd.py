"""`method=gkd` end to end: a teacher identical to the student gives exactly zero loss, a larger
teacher is distilled (the divergence falls), on-policy batches are sampled in the generate
phase, and the teacher's settings are validated before anything loads."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

GKD = ["method=gkd", "method.max_new_tokens=16", "train.scheduler=constant"]


def test_identical_teacher_gives_zero_loss(job):
    s = job(GKD + ["method.lmbda=0", "train.steps=1"])
    assert s["status"] == "ok", s["error"]
    assert abs(s["train"]["loss_curve"][0]) < 1e-5  # the JSD's mixture rounds (~4e-7)
    fwd = job(GKD + ["method.lmbda=0", "train.steps=1", "method.beta=0"])
    assert fwd["train"]["loss_curve"] == [0.0]  # KL(teacher || student) of equal logits
    models = s["memory"]["models"]
    assert models["teacher"]["bytes"] == models["policy"]["bytes"]
    assert "generate" not in s["memory"]["by_phase"]  # lmbda=0, no seq_kd: nothing sampled


def test_a_larger_teacher_is_distilled(job):
    s = job(GKD + ["method.teacher={hidden_size: 128, seed: 1}", "method.lmbda=0",
                   "train.steps=10", "train.lr=1e-2", "data.n_examples=8",
                   "train.batch_size=4", "measure.memory_steps=1"])
    assert s["status"] == "ok", s["error"]
    loss = s["train"]["loss_curve"]
    assert sum(loss[-3:]) / 3 < 0.75 * loss[0], loss
    models = s["memory"]["models"]
    assert models["teacher"]["total"] > 2 * models["policy"]["total"]


def test_on_policy_batches_are_the_students_samples(job):
    s = job(GKD + ["method.teacher={seed: 1}", "method.lmbda=1", "train.steps=2"])
    assert s["status"] == "ok", s["error"]
    assert s["train"]["curves"]["on_policy"] == [1.0, 1.0]
    assert s["memory"]["by_phase"]["generate"] > 0
    assert s["train"]["loss_curve"][0] > 0  # a teacher with another init disagrees


def test_teacher_settings_are_validated(job):
    s = job(GKD + ["method.teacher={hiden_size: 128, vocab_size: 99}", "method.beta=2"])
    assert s["status"] == "invalid"
    for needle in ("method.teacher.hiden_size: not an option of model=tiny",
                   "share the student's tokenizer", "method (gkd).beta: must be in [0, 1]"):
        assert needle in s["error"], (needle, s["error"])


def test_estimate_counts_the_teacher_and_its_sampling(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAB_CPU_BF16", "0")  # checks no precision: as on any CPU
    import json

    from memlab.cli.estimate import main as estimate_main

    base = ["method=gkd", "model.hidden_size=64", "model.intermediate_size=128",
            "method.max_length=128", "train.batch_size=2", "train.device=cpu"]
    assert estimate_main([*base, "method.lmbda=0", "method.teacher={hidden_size: 128}",
                          "--out", str(tmp_path / "a")]) == 0
    est = json.loads((tmp_path / "a" / "estimate.json").read_text())
    student = estimate_main([*base, "method=sft", "--out", str(tmp_path / "b")])
    assert student == 0
    sft = json.loads((tmp_path / "b" / "estimate.json").read_text())
    # the frozen teacher (hidden 128) adds more parameter bytes than the student has
    assert est["by_category"]["parameters"] > 2 * sft["by_category"]["parameters"]
    # on-policy sampling (lmbda > 0): a measured generate phase, the training batch is the
    # longest prompts + max_new_tokens sampled tokens
    assert estimate_main([*base, "method.lmbda=0.5", "method.max_new_tokens=24",
                          "--out", str(tmp_path / "c")]) == 0
    gen = json.loads((tmp_path / "c" / "estimate.json").read_text())
    assert gen["status"] == "ok" and gen["by_phase"]["generate"] > 0
    assert "generate" not in est["by_phase"]
    rows, width = gen["batch"]["shapes"]["input_ids"]
    assert rows == 2 and 24 < width <= 128 + 24  # prompts (<= max_length) + 24 new tokens
