"""The optimizer and the learning-rate schedule a run trains with."""

from __future__ import annotations

import math

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


def build_scheduler(opt: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``train.warmup_steps``, then constant / linear / cosine decay to 0
    at ``train.steps``."""
    total, warm = max(1, cfg.steps), cfg.warmup_steps

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if cfg.scheduler == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
