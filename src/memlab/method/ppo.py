"""`method=ppo`: Proximal Policy Optimization for language models, as TRL's PPOTrainer defines
it, with four roles: the policy, a frozen reference, a trainable value model (the model group
with a one-output classification head, a separate network as in TRL) and the reward (memlab's
reward functions, ``memlab.method._online``; a reward *model* is not wired in yet).

Each optimizer step (the generate phase, no gradients):

1. one completion per prompt is sampled from the policy;
2. per-token log-probs of the completion under the policy and the reference, and the value
   model's per-token values, are computed;
3. per-token rewards are ``-beta * (logp - ref_logp)`` (TRL's ``kl_coef``), plus the reward functions' score
   (minus ``missing_eos_penalty`` without EOS) on the completion's last token;
4. advantages by GAE (``gamma``, ``lam``) over the completion tokens, returns = advantages +
   values; advantages are whitened over the batch.

Then the loss on the same batch (one PPO epoch, one mini-batch per optimizer step):
clipped policy surrogate ``-min(ratio * A, clip(ratio, 1 +- cliprange) * A)`` plus ``vf_coef`` x
the clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``, averaged over completion
tokens. The optimizer updates policy and value model together.

Runs in one process for now (the value model is not wrapped by DDP / FSDP2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch

from memlab.method import _layout, _reference, _rollout
from memlab.method._online import Online
from memlab.method.base import Batch, register
from memlab.registry import Fraction, NonNegativeFloat, PositiveFloat, PositiveInt, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("ppo")
@dataclass(kw_only=True)
class PPO(Online):
    """PPO knobs, named as in TRL's PPOConfig."""

    num_generations: PositiveInt = 1
    """Completions per prompt (PPO's baseline is the value model, not a group)."""
    beta: NonNegativeFloat = 0.05
    """Per-token KL penalty in the reward (TRL's ``kl_coef``)."""
    cliprange: PositiveFloat = 0.2
    """Clip of the policy's probability ratio (1 +- cliprange)."""
    cliprange_value: PositiveFloat = 0.2
    """Clip of the value head's change from its rollout estimate."""
    vf_coef: NonNegativeFloat = 0.1
    """Weight of the value loss in the total loss."""
    gamma: Fraction = 1.0
    """Discount of future rewards (1.0: none)."""
    lam: Fraction = 0.95
    """GAE's lambda: bias-variance trade-off of the advantage estimate."""
    whiten_advantages: bool = True
    """Normalise the advantages to zero mean and unit variance over the batch."""
    missing_eos_penalty: Annotated[float, Range()] | None = None
    """Subtracted from the score of a completion that ends without the end-of-sequence token
    (TRL's missing_eos_penalty); None: no penalty."""

    min_generations: ClassVar[int] = 1
    trains_extra_models: ClassVar[bool] = True

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if self.cliprange <= 0 or self.cliprange_value <= 0:
            errors.append("method.cliprange and method.cliprange_value must be > 0")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            errors.append("method.gamma and method.lam must be in [0, 1]")
        if self.mask_truncated_completions:
            errors.append("method=ppo penalises completions without EOS with "
                          "method.missing_eos_penalty; set mask_truncated_completions=false")
        return errors

    # ------------------------------------------------------------------ models
    def extra_models(self, policy, ctx: BuildContext, build) -> dict[str, Any]:
        """The reference (frozen copy, or the disabled adapter) and the value model (the model
        group with a one-output head, trainable, no PEFT)."""
        models = _reference.reference_models(self, policy, ctx, build)
        models["value"] = build(head="seq_cls", trainable=True)
        return {**models, **self.reward_model_instances(build)}

    # ------------------------------------------------------------------ rollout
    def advantages_for(self, models, rewards, t, metrics, ctx) -> torch.Tensor:
        """Fills ``t`` with old log-probs, values, per-token advantages and returns (``[N, L]``
        completion grids); returns the per-sequence score (kept for the batch layout; PPO's
        advantages are per token)."""
        mask = t["completion_mask"].float()
        with torch.no_grad():
            with _reference.frozen_forward(models["policy"]) as m:
                logps = self.completion_logps(m, t, ctx)
            with _reference.reference_forward(self, models) as ref:
                ref_logps = self.completion_logps(ref, t, ctx)
            with _reference.frozen_forward(models["value"]) as v:
                values = self.completion_values(v, t, ctx) * mask
        score = rewards.to(logps.device, logps.dtype)
        if self.missing_eos_penalty:
            score = score - self.missing_eos_penalty * (~t["finished"]).to(score.dtype)
        kl = (logps - ref_logps) * mask
        per_token = -self.beta * kl
        last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)
        per_token = per_token + last.float() * score[:, None]
        adv = gae(per_token, values, mask, self.gamma, self.lam)
        returns = adv + values
        if self.whiten_advantages:
            n = mask.sum().clamp(min=1)
            mean = (adv * mask).sum() / n
            var = (((adv - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
            adv = (adv - mean) / (var.sqrt() + 1e-8) * mask
        t.update(old_logps=logps, old_values=values, token_advantages=adv, returns=returns)
        metrics.update({"kl": float(kl.sum(1).mean()),
                        "score": float(score.mean()),
                        "values/mean": float((values * mask).sum() / mask.sum().clamp(min=1))})
        return score

    def completion_values(self, model, t, ctx) -> torch.Tensor:
        """``[N, L]`` the value model's values at the positions that predict completion
        tokens (:func:`memlab.method._rollout.completion_values`)."""
        return _rollout.completion_values(model, t, self.labelled(), _layout.attention_of(ctx))

    def num_items(self, completion_tokens: int, completions: int) -> int:
        return completion_tokens

    # ------------------------------------------------------------------ loss
    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        t = batch.tensors
        mask = t["completion_mask"].float()
        logps = self.completion_logps(models["policy"], t, ctx)
        ratio = torch.exp(logps - t["old_logps"])
        adv = t["token_advantages"]
        pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - self.cliprange,
                                                 1 + self.cliprange) * adv)
        vpred = self.completion_values(models["value"], t, ctx)
        old_v = t["old_values"]
        v_clip = old_v + torch.clamp(vpred - old_v, -self.cliprange_value, self.cliprange_value)
        vf = 0.5 * torch.max((vpred - t["returns"]) ** 2, (v_clip - t["returns"]) ** 2)
        loss_sum = ((pg + self.vf_coef * vf) * mask).sum()
        n = mask.sum().clamp(min=1)
        metrics = dict(batch.meta.get("rollout", {}))
        metrics.update({"loss/policy": float((pg.detach() * mask).sum() / n),
                        "loss/value": float((vf.detach() * mask).sum() / n)})
        return loss_sum, metrics


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> torch.Tensor:
    """Generalized advantage estimation over the masked (completion) positions of each row,
    right to left; positions outside the mask get 0 and are skipped (the completion's tokens
    are contiguous)."""
    adv = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_v = torch.zeros_like(last)
    for i in reversed(range(rewards.shape[1])):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_v - values[:, i]
        cur = delta + gamma * lam * last
        adv[:, i] = cur * m
        last = torch.where(m > 0, cur, last)
        next_v = torch.where(m > 0, values[:, i], next_v)
    return adv
