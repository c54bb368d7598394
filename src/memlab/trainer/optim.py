"""The learning-rate schedule a run trains with, and the optimizer step inside backward (the
optimizer itself is the ``optimizer`` group's: :mod:`memlab.optimizer`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""``train.scheduler`` -> the name of transformers' schedule (``transformers.get_scheduler``)."""


def build_scheduler(opt: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' schedule (what TRL's trainers step): linear warm-up from 0 over
    ``train.warmup_steps``, then constant / linear / cosine decay to 0 at ``train.steps``."""
    from transformers import get_scheduler

    return get_scheduler(SCHEDULES[cfg.scheduler], opt, num_warmup_steps=cfg.warmup_steps,
                         num_training_steps=max(1, cfg.steps))


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
    embedding) has one hook, called once its gradients from both uses are summed."""
    where = {id(p): g for g in opt.param_groups for p in g["params"]}

    def hook(p: torch.Tensor) -> None:
        group = where[id(p)]
        every = group["params"]
        group["params"] = [p]
        try:
            opt.step()
        finally:
            group["params"] = every
        p.grad = None

    return [p.register_post_accumulate_grad_hook(hook) for p in params if id(p) in where]
