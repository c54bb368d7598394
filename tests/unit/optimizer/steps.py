"""What the optimizer tests share: a run's validated context, a small model with a tied
embedding / head and checkpointed blocks, the standard step against the in-backward step on
it, and an optimizer's state through memlab's checkpoint format."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memlab.context import BuildContext, validate
from memlab.trainer import state_files as ckpt
from memlab.trainer.optim import step_in_backward
from memlab_testing import FAST, compose

FIXED = ["train.max_grad_norm=null"]


def ctx_of(*overrides: str, platform=None) -> BuildContext:
    """The validated context of FAST + ``overrides`` (raises ConfigErrors)."""
    from omegaconf import OmegaConf, open_dict

    cfg = compose([*FAST, *overrides])
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.to_container(cfg, resolve=True), platform=platform)


def problems(*overrides: str, platform=None) -> str:
    """Every validation error of FAST + ``overrides``, as one text ('' when valid)."""
    from memlab.registry import ConfigErrors

    try:
        ctx_of(*overrides, platform=platform)
    except ConfigErrors as e:
        return "\n".join(e.errors)
    return ""


class Tied(nn.Module):
    """Embedding -> two checkpointed MLP blocks -> a head tied to the embedding (a tied weight
    gets its gradient from two places; a checkpointed block recomputes its forward in
    backward, after the blocks above it were stepped)."""

    def __init__(self, vocab: int = 48, dim: int = 24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                  nn.Linear(2 * dim, dim)) for _ in range(2))
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = h + checkpoint(b, h, use_reentrant=False)
        return self.norm(h) @ self.embed.weight.t()


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       ids[:, 1:].reshape(-1))


def train_both_ways(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                    steps: int = 5, model: nn.Module | None = None
                    ) -> tuple[nn.Module, nn.Module, list[float], list[float]]:
    """The same model trained ``steps`` steps with the standard step (backward, then
    ``opt.step()``) and with :func:`step_in_backward`; (standard, in-backward, their losses)."""
    torch.manual_seed(0)
    std = model or Tied()
    inb = copy.deepcopy(std)
    batches = [torch.randint(0, 48, (3, 9)) for _ in range(steps)]
    out = []
    for m, in_bwd in ((std, False), (inb, True)):
        params = [p for p in m.parameters() if p.requires_grad]
        opt = make(params)
        if in_bwd:
            step_in_backward(opt, params)
        losses = []
        for ids in batches:
            loss = loss_of(m, ids)
            loss.backward()
            if not in_bwd:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                assert all(p.grad is None for p in params)  # freed as they were used
            losses.append(float(loss.detach()))
        out.append(losses)
    return std, inb, out[0], out[1]


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p - q).detach().abs().max()) for p, q in pairs)


def resumed_equals_uninterrupted(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                                 where: Path, steps: int = 4) -> float:
    """Train ``steps`` steps straight, and ``steps // 2`` then a new optimizer loaded from the
    first one's state through memlab's checkpoint files (a JSON tree, the tensors in a
    safetensors file under ``where``) for the rest; the largest parameter difference."""
    torch.manual_seed(1)
    straight = Tied()
    resumed = copy.deepcopy(straight)
    batches = [torch.randint(0, 48, (3, 9)) for _ in range(steps)]
    opt = make(list(straight.parameters()))
    for ids in batches:
        loss_of(straight, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt = make(list(resumed.parameters()))
    for ids in batches[: steps // 2]:
        loss_of(resumed, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tensors: dict[str, torch.Tensor] = {}
    tree = json.loads(json.dumps(ckpt.to_tree(opt.state_dict(), tensors, "optimizer")))
    ckpt.save_tensors(where / "optimizer.safetensors", tensors)
    tensors = ckpt.load_tensors(where / "optimizer.safetensors")
    opt = make(list(resumed.parameters()))
    opt.load_state_dict(ckpt.from_tree(tree, tensors))
    for ids in batches[steps // 2:]:
        loss_of(resumed, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return max_param_diff(straight, resumed)
