"""`method=rloo`: REINFORCE Leave-One-Out, as TRL's RLOOTrainer defines it
(``memlab.method._online`` does the generation and scoring).

Sequence-level throughout: with ``beta > 0`` each completion's reward is lowered by ``beta`` x its
KL to the reference, summed over its tokens (policy minus reference log-probs, both without
gradient, computed in the generate phase); its advantage is that reward minus the mean reward of
the *other* completions of its prompt (the leave-one-out baseline); optionally the advantages are
normalised over the batch. The loss is a clipped surrogate on the completion's summed log-prob,
averaged over completions:

    loss = mean_i -min(ratio_i * A_i, clip(ratio_i, 1 - epsilon, 1 + epsilon_high) * A_i)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from memlab.method import _reference
from memlab.method._online import Clipped
from memlab.method.base import Batch, register
from memlab.registry import NonNegativeFloat, PositiveInt

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("rloo")
@dataclass(kw_only=True)
class RLOO(Clipped):
    """RLOO knobs, named as in TRL's RLOOConfig."""

    num_generations: PositiveInt = 2
    beta: NonNegativeFloat = 0.05
    """KL strength, applied to the reward (sequence level); 0 loads no reference model."""
    normalize_advantages: bool = False
    """Scale advantages to mean 0, std 1 over the batch."""

    def advantages_for(self, models, rewards, t, metrics, ctx) -> torch.Tensor:
        if self.beta > 0:
            kl = self._sequence_kl(models, t, ctx)
            metrics["kl"] = float(kl.mean())
            rewards = rewards - self.beta * kl.to(rewards.device, rewards.dtype)
        adv = leave_one_out(rewards, self.num_generations)
        if self.normalize_advantages:
            adv = (adv - adv.mean()) / (adv.std() + 1e-4)
        return adv

    def _sequence_kl(self, models, t, ctx) -> torch.Tensor:
        """Sum over completion tokens of log pi(token) - log pi_ref(token), no gradient."""
        with torch.no_grad():
            with _reference.frozen_forward(models["policy"]) as m:
                pol = self.completion_logps(m, t, ctx)
            with _reference.reference_forward(self, models) as ref:
                rl = self.completion_logps(ref, t, ctx)
        return (pol - rl).sum(1).float().cpu()

    def num_items(self, completion_tokens: int, completions: int) -> int:
        return completions

    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        t = batch.tensors
        logps = self.completion_logps(models["policy"], t, ctx).sum(1)
        old = t.get("old_logps")
        ratio = self.ratio(logps, None if old is None else old.sum(1))
        adv = t["advantages"].to(logps.dtype)
        per_seq, active = self.clipped(ratio, adv)
        valid = t["seq_valid"].to(per_seq.dtype)
        per_seq = per_seq * valid
        metrics = dict(batch.meta.get("rollout", {}))
        metrics["clip_ratio"] = float((active * valid).sum() / valid.sum().clamp(min=1))
        return per_seq.sum(), metrics


def leave_one_out(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Each reward minus the mean of the other rewards of its group."""
    r = rewards.view(-1, group)
    baseline = (r.sum(1, keepdim=True) - r) / (group - 1)
    equal = (r == r[:, :1]).all(1, keepdim=True)  # exactly 0, not a rounding of the sum
    return (r - baseline).masked_fill(equal, 0.0).reshape(-1)
