"""`method=grpo`: Group Relative Policy Optimization.

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

The recipe is :meth:`GRPO.rollout` then :meth:`GRPO.loss`, in order: 1. rollout (sample the
completions), 2. rewards, 3. advantages (:func:`advantages`), in the trainer's ``generate``
phase; 4. the loss, in its forward (after a ``num_iterations`` reuse too). What they call is
:mod:`memlab.method._online`'s (the steps every online method shares) and
:mod:`memlab.method._rollout`'s (prompts, reward functions, the training batch's tensors).
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
    from memlab.generation.base import GenerationEnv


@register("grpo")
@dataclass(kw_only=True)
class GRPO(Clipped):
    """GRPO knobs, named as in TRL's GRPOConfig where one exists."""

    supports_sampling_correction: ClassVar[bool] = True

    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."""
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"

    # ------------------------------------------------------------------ the recipe
    def rollout(self, models: dict, batch: Batch, ctx: BuildContext, env: GenerationEnv
                ) -> Batch:
        """Steps 1-3 (the generate phase): the training batch of ``batch``'s prompts."""
        real = not env.engine.placeholder_samples  # an estimate's placeholders: the worst case
        # 1. rollout: num_generations completions per prompt from the run's engine
        samples = self.generate(models, batch, env)
        # 2. rewards: the weighted reward functions and reward models, one per completion
        rewards, metrics = self.score(batch, samples, models)
        rows = self.rows(batch, samples, rewards, metrics, ctx, real)  # laid out for training
        # 3. advantages: each reward minus its group's mean (scaled: scale_rewards)
        adv = advantages(rewards, self.num_generations, self.scale_rewards)
        # the batch without the completions that add nothing (advantage 0 with beta=0)
        out = self.batch_of(rows, adv, batch, samples, ctx, real)
        if self.num_iterations > 1:  # what the ratio of the later iterations compares with
            out.tensors["old_logps"] = self.old_logps(models, out, ctx)
        return self.finish(models, out, samples, rewards, env, ctx, real)

    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """Step 4 (forward): the clipped surrogate (+ beta x KL to the reference) of the
        completion tokens, summed as ``loss_type`` says."""
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

    # ------------------------------------------------------------------ the recipe's parts
    def advantages_for(self, models, rewards, t, metrics, ctx) -> torch.Tensor:
        """Step 3 where :meth:`training_batch` asks for it (:func:`advantages`)."""
        return advantages(rewards, self.num_generations, self.scale_rewards)

    def zero_contribution(self, advantages: torch.Tensor) -> list[bool]:
        """With ``beta=0`` a completion of advantage 0 adds nothing; the KL term of
        ``beta > 0`` is per token, whatever the advantage."""
        if self.beta > 0:
            return [False] * advantages.shape[0]
        return super().zero_contribution(advantages)

    def num_items(self, completion_tokens: int, completions: int) -> int:
        return completion_tokens if self.loss_type == "dapo" else completions


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

