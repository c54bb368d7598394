"""train.scheduler: transformers' schedules, the values TRL's trainers step through."""

import math

import pytest
import torch

from memlab.config import TrainConfig
from memlab.trainer.optim import build_scheduler

C1, C3 = 0.5 * (1 + math.cos(math.pi / 4)), 0.5 * (1 + math.cos(3 * math.pi / 4))


def _adamw(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr)


@pytest.mark.parametrize(("name", "warmup", "expected"), [
    ("constant", 2, [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", 2, [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]),
    ("cosine", 2, [0.0, 0.5, 1.0, C1, 0.5, C3]),
    ("cosine", 0, [1.0, 0.5 * (1 + math.cos(math.pi / 6)), 0.75, 0.5, 0.25,
                   0.5 * (1 + math.cos(5 * math.pi / 6))]),
])
def test_schedule_values(name: str, warmup: int, expected: list[float]) -> None:
    """Warm-up from 0 (the first step of a warm-up trains at lr 0, as in transformers), then
    the decay reaches 0 at train.steps."""
    cfg = TrainConfig(steps=6, warmup_steps=warmup, scheduler=name, lr=2.0)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = _adamw([p], cfg)
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.0 * e for e in expected], abs=1e-12)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0 if name != "constant" else 2.0,
                                                      abs=1e-12)


def test_schedule_state_round_trips() -> None:
    """A resumed run's schedule continues where the saved one stopped."""
    cfg = TrainConfig(steps=10, warmup_steps=3, scheduler="cosine", lr=1.0)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = _adamw([p], cfg)
    sched = build_scheduler(opt, cfg)
    for _ in range(4):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = _adamw([torch.nn.Parameter(torch.zeros(1))], cfg)
    sched2 = build_scheduler(opt2, cfg)
    sched2.load_state_dict(state)
    assert sched2.last_epoch == 4
    assert sched2.lr_lambdas[0](sched2.last_epoch) == sched.lr_lambdas[0](sched.last_epoch)


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("steps", "warmup"), [(1, 0), (7, 0), (7, 3), (10, 10), (5, 9)])
def test_schedule_is_transformers(name: str, steps: int, warmup: int) -> None:
    """memlab writes the three formulas itself (importing transformers.optimization pulls in
    peft, 0.4 s a run); they give transformers.get_scheduler's factor at every step, past the
    end too."""
    from transformers import get_scheduler

    from memlab.trainer.optim import SCHEDULES

    cfg = TrainConfig(steps=steps, warmup_steps=warmup, scheduler=name, lr=1.0)
    hf_name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[name]
    ours = build_scheduler(_adamw([torch.nn.Parameter(torch.zeros(1))], cfg), cfg)
    theirs = get_scheduler(hf_name, _adamw([torch.nn.Parameter(torch.zeros(1))], cfg),
                           num_warmup_steps=warmup, num_training_steps=steps)
    assert name in SCHEDULES
    for step in range(steps + 3):
        assert ours.lr_lambdas[0](step) == theirs.lr_lambdas[0](step), (name, step)
