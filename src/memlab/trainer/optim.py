"""The learning-rate schedule a run trains with, and the optimizer step inside backward (the
optimizer itself is the ``optimizer`` group's: :mod:`memlab.optimizer`)."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

SCHEDULES = ("constant", "linear", "cosine")
"""``train.scheduler``'s values: transformers' ``constant_with_warmup``, ``linear`` and
``cosine`` schedules."""


def lr_factor(step: int, *, schedule: str, warmup: int, total: int) -> float:
    """The learning rate's factor at ``step``: transformers' schedule formulas exactly (tested
    against ``transformers.get_scheduler``), written here so that a run and an estimate do not
    import ``transformers.optimization`` (and peft with it: 0.4 s)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if schedule == "constant":
        return 1.0
    span = float(max(1, total - warmup))
    if schedule == "linear":
        return max(0.0, float(total - step) / span)
    progress = float(step - warmup) / span
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # one half-cosine to 0


def build_scheduler(opt: torch.optim.Optimizer, cfg, steps: int | None = None
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' schedule (what TRL's trainers step): linear warm-up from 0 over
    ``train.warmup_steps``, then constant / linear / cosine decay to 0 at the run's last step
    (``steps``: what ``train.epochs`` comes to; None: ``train.steps`` or its default)."""
    total = steps if steps is not None else cfg.fixed_steps()
    factor = functools.partial(lr_factor, schedule=cfg.scheduler, warmup=cfg.warmup_steps,
                               total=max(1, total or 1))
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def step_in_backward(opt: torch.optim.Optimizer, params: list[nn.Parameter]
                     ) -> list[RemovableHandle]:
    """``optimizer.in_backward``: each of ``params`` is stepped by ``opt`` in its
    post-accumulate-grad hook, as soon as backward has produced its gradient, which is then
    freed. Returns the hooks' handles.

    One optimizer steps every parameter (its state dict, schedule and checkpoints are those of
    the standard step, whichever way a run steps), one parameter at a time: for the call, the
    parameter's param group holds that parameter alone, so the optimizer's own update runs on
    it with its own state, exactly as the standard step would after backward (per-parameter
    updates: AdamW, SGD, Adafactor, 8-bit AdamW). A tied weight (a head sharing the input
    embedding) has one hook, called once its gradients from both uses are summed. A
    parameter's group is looked up by its index at each call: ``opt.load_state_dict`` (a
    resumed run loads the state after the hooks are set) replaces the group dicts.

    A torch optimizer left to its default implementation (``foreach=None``: on a CPU the
    single-tensor loop, whose AdamW holds two parameter-sized temporaries, ``sqrt`` then the
    division) runs its multi-tensor one for the call: on one parameter it holds one
    temporary and gives the same floats (the same operations in the same order: AdamW and SGD
    measured bit for bit on a CPU; on CUDA it is torch's default already). The group's
    ``foreach`` is restored after the call: the state dict is the standard step's."""
    where = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}

    def hook(p: torch.Tensor) -> None:
        _step_one(opt, opt.param_groups[where[id(p)]], p)
        p.grad = None

    return [p.register_post_accumulate_grad_hook(hook) for p in params if id(p) in where]


def _default_impl(group: dict) -> bool:
    """A torch optimizer's group left to its default implementation (``foreach`` None, not
    fused): on a CPU torch's single-tensor loop."""
    return "foreach" in group and group["foreach"] is None and not group.get("fused")


def _step_one(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> None:
    """``opt``'s update of ``p`` alone (its group holding only ``p`` for the call), with the
    multi-tensor implementation where the group is left to the default."""
    every, default = group["params"], _default_impl(group)
    group["params"] = [p]
    if default:
        group["foreach"] = True
    try:
        opt.step()
    finally:
        group["params"] = every
        if default:
            group["foreach"] = None


def step(opt: torch.optim.Optimizer) -> None:
    """The standard step after backward: ``opt.step()``, except where every group is a torch
    optimizer's at its default implementation on CPU tensors. There torch's single-tensor loop
    makes two temporaries of each parameter's size (AdamW's ``exp_avg_sq.sqrt()``, then the
    division), so the peak of a step holds two copies of the largest parameter over every
    gradient and state; each parameter is stepped alone with the multi-tensor code instead,
    which makes one, with the same floats (as in :func:`step_in_backward`)."""
    groups = opt.param_groups
    if not all(_default_impl(g) for g in groups) or any(
            p.device.type != "cpu" for g in groups for p in g["params"]):
        opt.step()
        return
    for group in groups:
        for p in list(group["params"]):
            if p.grad is not None:
                _step_one(opt, group, p)
