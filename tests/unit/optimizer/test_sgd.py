"""optimizer=sgd: momentum and Nesterov reach torch's SGD (Nesterov without momentum is
refused), the in-backward step equals the standard one with a momentum buffer, and the buffer
resumes through memlab's checkpoint files."""

from __future__ import annotations

import torch

from unit.optimizer.steps import (
    ctx_of,
    max_param_diff,
    problems,
    resumed_equals_uninterrupted,
    train_both_ways,
)


def test_knobs_reach_torch_sgd():
    ctx = ctx_of("optimizer=sgd", "optimizer.momentum=0.9", "optimizer.nesterov=true",
                 "train.weight_decay=0.01")
    opt = ctx.optimizer.build([torch.nn.Parameter(torch.zeros(2))], ctx)
    g = opt.param_groups[0]
    assert isinstance(opt, torch.optim.SGD)
    assert (g["momentum"], g["nesterov"], g["weight_decay"]) == (0.9, True, 0.01)
    assert "optimizer.momentum > 0" in problems("optimizer=sgd", "optimizer.nesterov=true")


def test_in_backward_equals_the_standard_step_with_momentum():
    std, inb, _, _ = train_both_ways(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert max_param_diff(std, inb) <= 1e-5


def test_momentum_resumes_through_the_checkpoint_files(tmp_path):
    assert resumed_equals_uninterrupted(
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), tmp_path) == 0.0
