"""`method=grpo`: Group Relative Policy Optimization (``memlab.method._online`` does the
generation and scoring).

A completion's advantage is its reward minus its group's mean (divided by the group's std with
``scale_rewards=group``, the batch's with ``batch``, or nothing with ``none``: Dr. GRPO), and
the policy takes a clipped-surrogate step on the completion tokens:

    per_token = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
                + beta * KL_k3(policy || reference)

``ratio`` is ``exp(logp - logp.detach())``: 1 in value, with the policy gradient
``A * grad logp``. ``loss_type`` normalises it: ``dapo`` (default): summed over every completion
token of the whole step and divided by their count (token-level, over micro-batches and ranks);
``grpo``: each completion's mean, averaged over completions; ``dr_grpo``: summed over tokens,
divided by completions x ``max_completion_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from memlab.method import _reference
from memlab.method._online import Clipped
from memlab.method.base import Batch, register

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("grpo")
@dataclass(kw_only=True)
class GRPO(Clipped):
    """GRPO knobs, named as in TRL's GRPOConfig where one exists."""

    supports_sampling_correction: ClassVar[bool] = True

    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."""
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"

    def advantages_for(self, models, rewards, t, metrics, ctx) -> torch.Tensor:
        return advantages(rewards, self.num_generations, self.scale_rewards)

    def zero_contribution(self, advantages: torch.Tensor) -> list[bool]:
        """With ``beta=0`` a completion of advantage 0 adds nothing; the KL term of
        ``beta > 0`` is per token, whatever the advantage."""
        if self.beta > 0:
            return [False] * advantages.shape[0]
        return super().zero_contribution(advantages)

    def num_items(self, completion_tokens: int, completions: int) -> int:
        return completion_tokens if self.loss_type == "dapo" else completions

    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        t = batch.tensors
        logps = self.completion_logps(models["policy"], t, ctx)  # [N, L]
        mask = t["completion_mask"].to(logps.dtype)
        ratio = self.ratio(logps, t.get("old_logps"))
        adv = t["advantages"].to(logps.dtype)[:, None]
        per_token, active = self.clipped(ratio, adv)
        metrics: dict[str, float] = dict(batch.meta.get("rollout", {}))
        metrics["clip_ratio"] = float((active * mask).sum() / mask.sum().clamp(min=1))
        if self.beta > 0:
            with _reference.reference_forward(self, models) as ref:
                ref_logps = self.completion_logps(ref, t, ctx)
            d = ref_logps - logps
            kl = torch.exp(d) - d - 1
            per_token = per_token + self.beta * kl
            metrics["kl"] = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
        if "is_weights" in t:  # generation=vllm with importance_sampling_correction
            per_token = per_token * t["is_weights"].to(per_token.dtype)
        per_token = per_token * mask
        if self.loss_type == "dapo":
            loss_sum = per_token.sum()
        elif self.loss_type == "grpo":
            loss_sum = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum()
        else:  # dr_grpo
            loss_sum = per_token.sum() / self.max_completion_length
        return loss_sum, metrics


def advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Reward minus its group's mean; divided by the group's std (``group``), the batch's
    (``batch``) or nothing (``none``). A group whose rewards are all equal gets 0."""
    r = rewards.view(-1, group)
    centered = r - r.mean(1, keepdim=True)
    if scale == "group":
        centered = centered / (r.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        centered = centered / (rewards.std() + 1e-4)
    equal = (r == r[:, :1]).all(1, keepdim=True)  # exactly 0, not a rounding of the mean
    return centered.masked_fill(equal, 0.0).reshape(-1)

