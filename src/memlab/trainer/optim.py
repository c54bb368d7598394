"""The optimizer and the learning-rate schedule a run trains with."""

from __future__ import annotations

import torch
from torch import nn


def build_optimizer(params: list[nn.Parameter], cfg, foreach: bool | None = None
                    ) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``params``. ``foreach``: torch's multi-tensor implementation
    (None: torch's default for the parameters' device)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               foreach=foreach)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas),
                             weight_decay=cfg.weight_decay, foreach=foreach)


SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
"""``train.scheduler`` -> the name of transformers' schedule (``transformers.get_scheduler``)."""


def build_scheduler(opt: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' schedule (what TRL's trainers step): linear warm-up from 0 over
    ``train.warmup_steps``, then constant / linear / cosine decay to 0 at ``train.steps``."""
    from transformers import get_scheduler

    return get_scheduler(SCHEDULES[cfg.scheduler], opt, num_warmup_steps=cfg.warmup_steps,
                         num_training_steps=max(1, cfg.steps))
