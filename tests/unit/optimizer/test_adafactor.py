"""optimizer=adafactor (transformers' Adafactor with memlab's learning rate): a matrix's state
is its factored second moment (a row and a column vector), which the tracker books as
``optimizer``; ZeRO's flat partitions are refused; the in-backward step equals the standard
one; the state resumes through memlab's checkpoint files."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memlab.measure.memory import MemoryProbe
from unit.optimizer.steps import (
    FIXED,
    ctx_of,
    max_param_diff,
    problems,
    resumed_equals_uninterrupted,
    train_both_ways,
)


def _adafactor(ps):
    from transformers.optimization import Adafactor

    return Adafactor(ps, lr=1e-2, relative_step=False, scale_parameter=False)


def test_factored_state_is_booked_as_optimizer():
    ctx = ctx_of("optimizer=adafactor", "train.lr=0.01")
    model = nn.Linear(96, 40, bias=False)
    opt = ctx.optimizer.build(list(model.parameters()), ctx)
    g = opt.param_groups[0]
    assert (g["lr"], g["relative_step"], g["scale_parameter"]) == (0.01, False, False)
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()  # the state is made by the first update
    opt.zero_grad(set_to_none=True)
    state = opt.state[model.weight]
    assert state["exp_avg_sq_row"].shape == (40,) and state["exp_avg_sq_col"].shape == (96,)
    assert "exp_avg" not in state  # beta1 null: no first moment
    probe = MemoryProbe("cpu")
    probe.watch(model, opt)
    with probe.step(1, True), probe.phase("forward"):
        model(torch.ones(3, 96)).sum()
    # the row and the column and the RMS scalar, fp32: nothing parameter-sized
    assert probe.result()["by_category"]["optimizer"] == 4 * (40 + 96 + 1)


def test_zero_flat_partitions_are_refused_and_whole_parameters_are_not():
    text = problems("optimizer=adafactor", "distributed=deepspeed")
    assert "flat partitions" in text and "factors the second moment" in text
    text = problems("optimizer=adafactor", "distributed=deepspeed",
                    "distributed.zero_stage=0")
    assert "flat partitions" not in text
    assert problems("optimizer=adafactor", "optimizer.in_backward=true", *FIXED) == ""


def test_in_backward_equals_the_standard_step():
    std, inb, _, _ = train_both_ways(_adafactor)
    assert max_param_diff(std, inb) <= 1e-5


def test_state_resumes_through_the_checkpoint_files(tmp_path):
    assert resumed_equals_uninterrupted(_adafactor, tmp_path) == 0.0


@pytest.mark.pipeline
def test_a_run_resumes_its_state_whichever_way_it_steps(job):
    """A run stepping Adafactor inside backward saves at step 2; resumed with the standard
    step (in_backward is not a training difference: the same parameters), the rest of its loss
    curve is the straight run's."""
    o = [*FIXED, "optimizer=adafactor", "train.lr=0.01", "train.steps=4",
         "method.max_length=32", "model.hidden_size=64", "model.intermediate_size=128"]
    straight = job([*o, "optimizer.in_backward=true", "train.save_every=2"])
    assert straight["status"] == "ok", straight["error"]
    ckpt = f"{straight['run_dir']}/checkpoints/step_000002"
    resumed = job([*o, f"train.resume_from={ckpt}"])
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["train"]["loss_curve"] == pytest.approx(straight["train"]["loss_curve"],
                                                           abs=1e-5)
    assert resumed["resume"]["step"] == 2
