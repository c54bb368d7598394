"""Evaluation while training (``data.eval``, ``train.eval_*``; :mod:`memlab.trainer.evaluate`):
the eval loss is weighted by tokens (pairs) over the whole held-out set, so it does not depend on
the eval batch size or on packing (ranks: tests/integration/test_distributed.py); preference
evaluations report TRL's metrics; the best checkpoint survives pruning and early stopping's
count survives a resume; the eval phase is measured, and estimated to the byte; online methods
are evaluated on the reward of greedy completions; bad settings are refused before anything
loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memlab import pipeline
from memlab.context import validate
from memlab.registry import ConfigErrors
from memlab.run import seed_everything
from memlab_testing import choices_of, compose, with_fast

pytestmark = pytest.mark.integration

HELD = ["data.eval=0.25"]  # 8 of FAST's 32 generated conversations


def _context(tmp_path: Path, overrides: list[str]):
    from omegaconf import OmegaConf, open_dict

    cfg = compose(with_fast(overrides))
    choices = choices_of(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.create(OmegaConf.to_container(cfg)), tmp_path, choices)


def _evaluate_at_init(tmp_path: Path, overrides: list[str]) -> dict[str, float]:
    """The evaluation of the freshly built policy (the same weights for every overrides: the
    tiny model is seeded)."""
    ctx = _context(tmp_path, overrides)
    seed_everything(ctx.train.seed)
    trainer = pipeline.build(ctx).trainer
    metrics, best = trainer.evaluator.run(trainer)
    assert best and trainer.evaluator.state.history[0]["step"] == 0
    return metrics


def test_eval_loss_does_not_depend_on_the_eval_batch_size_or_packing(tmp_path):
    """Token-weighted over the whole held-out set: one row at a time, packed rows three a
    batch (the last batch short), one padding-free row of four: the same loss."""
    cases = {"1 row": ["train.eval_batch_size=1"],
             "packed bfd, 3 rows": ["packing=bfd", "train.eval_batch_size=3"],
             "padding-free, 4 rows": ["method.padding_free=true", "train.eval_batch_size=4"]}
    losses = {name: _evaluate_at_init(tmp_path, [*HELD, *o])["loss"] for name, o in cases.items()}
    first = losses["1 row"]
    assert 7 < first < 10  # ~ln(vocab) for random weights
    for name, loss in losses.items():
        assert loss == pytest.approx(first, rel=1e-6), (name, losses)


def test_preference_eval_reports_trl_metrics_whatever_the_batch(job):
    """DPO after two steps: the eval loss and rewards/chosen, rejected, margins, accuracies as
    TRL logs them, the same for one pair or three pairs a batch; best_metric follows the
    accuracy (greater is better)."""
    o = ["method=dpo", "method.max_length=96", "train.steps=2", *HELD,
         "train.best_metric=rewards/accuracies"]
    one, three = job([*o, "train.eval_batch_size=1"]), job([*o, "train.eval_batch_size=3"])
    assert one["status"] == three["status"] == "ok", (one["error"], three["error"])
    final = one["eval"]["final"]
    assert set(final) == {"step", "loss", "rewards/chosen", "rewards/rejected",
                          "rewards/margins", "rewards/accuracies", "logps/chosen",
                          "logps/rejected"}
    for k, v in final.items():
        assert three["eval"]["final"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert final["rewards/margins"] == pytest.approx(
        final["rewards/chosen"] - final["rewards/rejected"], abs=1e-6)
    assert final["rewards/chosen"] != 0  # the policy moved away from its reference
    assert one["eval"]["metric"] == "rewards/accuracies" and one["eval"]["greater_is_better"]
    assert one["eval"]["best"]["value"] == final["rewards/accuracies"]
    assert one["eval"]["examples"] == three["eval"]["examples"] > 0


def test_best_checkpoint_survives_pruning_and_early_stopping_survives_a_resume(job):
    """greater_is_better=true on a falling loss: the first evaluation stays the best. Run A:
    evaluated and saved at steps 1 and 2, keep_last=1 keeps step 2 and the best, step 1. Run B
    resumes from step 2 with the count of evaluations without improvement (1): it stops after
    two more (early_stop=3), at step 4 of 8."""
    o = [*HELD, "train.eval_every=1", "train.save_every=1", "train.save_best=true",
         "train.keep_last=1", "train.early_stop=3", "train.greater_is_better=true"]
    a = job([*o, "train.steps=2"])
    assert a["status"] == "ok", a["error"]
    checkpoints = Path(a["run_dir"]) / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "step_000002"]
    assert a["eval"]["best"] == {"step": 1, "value": a["eval"]["history"][0]["loss"],
                                 "checkpoint": str(checkpoints / "step_000001")}
    losses = [h["loss"] for h in a["eval"]["history"]]
    assert losses[1] < losses[0]  # the held-out loss falls: "greater" never improves
    b = job([*o, "train.steps=8", f"train.resume_from={checkpoints / 'step_000002'}",
             "train.resume_allow=[train.steps]"])
    assert b["status"] == "ok", b["error"]
    assert b["train"]["steps"] == 4 and b["train"]["steps_planned"] == 8
    assert [h["step"] for h in b["eval"]["history"]] == [1, 2, 3, 4]
    assert b["eval"]["history"][:2] == a["eval"]["history"]
    assert b["eval"]["stopped_early"]["step"] == 4
    assert "in 3 evaluations" in b["eval"]["stopped_early"]["reason"]
    assert b["eval"]["best"] == a["eval"]["best"]  # in run A's dir, never pruned by B
    assert (checkpoints / "step_000001").is_dir()
    assert sorted(p.name for p in (Path(b["run_dir"]) / "checkpoints").iterdir()) == [
        "step_000004"]


def test_the_eval_phase_is_measured_and_estimated_to_the_byte(job, tmp_path):
    """The eval phase runs without gradients, after the steps (the optimizer's state alive);
    with a larger eval batch it is the run's peak; memlab estimate measures the same phase on
    the same shapes to the byte (packed rows of one long document each). The held-out rows'
    tokens are not training tokens."""
    from memlab.cli.estimate import main as estimate_main

    o = ["model.hidden_size=128", "model.intermediate_size=384", "train.batch_size=2",
         "data.median_tokens=3000", "packing=bfd", "method.loss_on=all",
         "method.max_length=256", *HELD, "train.eval_batch_size=4"]
    real = job([*o, "measure.memory_steps=all", "train.steps=2"])
    assert real["status"] == "ok", real["error"]
    rm = real["memory"]
    assert list(rm["by_phase"]) == ["forward", "backward", "optimizer", "eval"]
    cats = rm["by_phase_category"]["eval"]
    assert cats["gradients"] == 0 and cats["optimizer"] > 0
    assert rm["peak_at"] == {"step": 2, "phase": "eval"}
    assert real["data"]["tokens_trained"] == 2 * 2 * 256  # 2 steps of 2 full rows: no eval
    assert real["eval"]["tokens"] == 8 * 256
    assert estimate_main([*with_fast(o), "--out", str(tmp_path / "est")]) == 0
    est = json.loads((tmp_path / "est" / "estimate.json").read_text())
    assert est["by_phase"]["eval"] == rm["by_phase"]["eval"]
    assert est["by_phase_category"]["eval"] == cats
    assert est["peak_at"]["phase"] == "eval"


def test_online_methods_are_evaluated_on_greedy_completions(job):
    """GRPO: the held-out prompts' greedy completions, scored by the run's rewards; greedy, so
    the evaluation repeats exactly; the samples are greedy completions too."""
    o = ["method=grpo", "method.max_prompt_length=32", "method.max_completion_length=8",
         "method.num_generations=2", "train.steps=1", *HELD, "train.eval_samples=2",
         "train.eval_max_new_tokens=8", "train.save_final=true"]
    s = job(o)
    assert s["status"] == "ok", s["error"]
    final = s["eval"]["final"]
    assert set(final) >= {"reward", "rewards/length", "completions/mean_length"}
    assert final["reward"] == pytest.approx(final["rewards/length"])
    assert 1 <= final["completions/mean_length"] <= 8
    assert s["eval"]["metric"] == "reward" and s["eval"]["greater_is_better"]
    assert "eval" in s["memory"]["by_phase"]
    assert [x["step"] for x in s["eval"]["samples"]] == [1, 1]
    assert all(x["prompt"] and isinstance(x["completion"], str) for x in s["eval"]["samples"])


def test_bad_evaluation_settings_are_refused_at_once(tmp_path):
    with pytest.raises(ConfigErrors) as e:
        _context(tmp_path, ["train.eval_every=5", "train.save_best=true",
                            "train.best_metric=accuracy"])
    (only,) = e.value.errors
    assert "train.eval_every, train.save_best, train.best_metric" in only
    assert "data.eval=0.05" in only
    with pytest.raises(ConfigErrors) as e:
        _context(tmp_path, ["data.eval=test", "train.best_metric=rewards/accuracy"])
    text = "\n".join(e.value.errors)
    assert "data.eval=test: no such file, and data=embedded has no named splits" in text
    assert "method=sft's evaluation reports loss" in text
    with pytest.raises(ConfigErrors) as e:
        _context(tmp_path, ["method=dpo", "data.eval=0.5", "train.best_metric=rewards/accuracy"])
    assert "did you mean 'rewards/accuracies'?" in e.value.errors[0]
    with pytest.raises(ConfigErrors) as e:
        _context(tmp_path, ["data.eval=1.5"])
    assert "eval: must be in (0, 1) or must be a string" in e.value.errors[0]
    with pytest.raises(ConfigErrors) as e:
        _context(tmp_path, [f"data.eval={tmp_path}/absent.jsonl"])
    assert f"data.eval='{tmp_path}/absent.jsonl'" in e.value.errors[0]
    assert "no such file" in e.value.errors[0]
