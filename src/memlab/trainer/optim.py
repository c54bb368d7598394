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


def build_scheduler(opt: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' schedule (what TRL's trainers step): linear warm-up from 0 over
    ``train.warmup_steps``, then constant / linear / cosine decay to 0 at ``train.steps``."""
    factor = functools.partial(lr_factor, schedule=cfg.scheduler, warmup=cfg.warmup_steps,
                               total=max(1, cfg.steps))
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
        group = opt.param_groups[where[id(p)]]
        every = group["params"]
        default = "foreach" in group and group["foreach"] is None and not group.get("fused")
        group["params"] = [p]
        if default:
            group["foreach"] = True
        try:
            opt.step()
        finally:
            group["params"] = every
            if default:
                group["foreach"] = None
        p.grad = None

    return [p.register_post_accumulate_grad_hook(hook) for p in params if id(p) in where]
