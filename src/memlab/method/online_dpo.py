"""`method=online_dpo`: Online DPO (as TRL's OnlineDPOTrainer): each prompt gets two
completions from the current policy (``memlab.method._online`` generates and scores them), the
better-rewarded one is "chosen", and the policy takes a DPO step on that fresh pair against a
frozen reference (a copy, or the LoRA policy with its adapter off).

``missing_eos_penalty`` is subtracted from the reward of a completion that did not end with EOS
(TRL's knob against rambling). Ties keep the first completion as chosen. The loss normaliser is
the number of pairs (prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import torch

from memlab.losses import dpo_loss
from memlab.method import _reference
from memlab.method._online import Online
from memlab.method.base import Batch, register
from memlab.registry import PositiveFloat, PositiveInt, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("online_dpo")
@dataclass(kw_only=True)
class OnlineDPO(Online):
    """Online DPO knobs, named as in TRL's OnlineDPOConfig."""

    reuses_rollouts: ClassVar[bool] = False

    num_generations: PositiveInt = 2
    """Two completions per prompt: the pair."""
    beta: PositiveFloat = 0.1
    """Strength of the implicit KL penalty to the reference (DPO's beta)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid (DPO's) or ipo."""
    missing_eos_penalty: Annotated[float, Range()] | None = None
    """Subtracted from the reward of a completion that ends without the end-of-sequence token
    (TRL's missing_eos_penalty); None: no penalty."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if self.num_generations != 2:
            errors.append(f"method.num_generations must be 2 for method=online_dpo (one pair "
                          f"per prompt; got {self.num_generations})")
        if self.beta <= 0:
            errors.append(f"method.beta must be > 0 for method=online_dpo (got {self.beta})")
        if self.mask_truncated_completions:
            errors.append("method.mask_truncated_completions=true would leave half-pairs; "
                          "method=online_dpo penalises them with method.missing_eos_penalty")
        return errors

    def extra_models(self, policy, ctx: BuildContext, build):
        return {**_reference.reference_models(self, policy, ctx, build),
                **self.reward_model_instances(build)}

    def advantages_for(self, models, rewards, t, metrics, ctx) -> torch.Tensor:
        """+1 for the chosen completion of each pair, -1 for the rejected one."""
        if self.missing_eos_penalty:
            unfinished = (~t["finished"]).to(rewards.device, rewards.dtype)
            rewards = rewards - self.missing_eos_penalty * unfinished
        r = rewards.view(-1, 2)
        first = r[:, 0] >= r[:, 1]
        metrics["rewards/pair_margin"] = float((r[:, 0] - r[:, 1]).abs().mean())
        sign = torch.stack([first, ~first], 1).float() * 2 - 1
        return sign.reshape(-1)

    def num_items(self, completion_tokens: int, completions: int) -> int:
        return completions // 2

    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        t = batch.tensors
        n = t["completion_mask"].sum(1).clamp(min=1)
        with _reference.reference_forward(self, models) as ref:
            ref_logps = self.completion_logps(ref, t, ctx).sum(1)
        logps = self.completion_logps(models["policy"], t, ctx).sum(1)
        if self.loss_type == "ipo":  # IPO is defined on length-averaged log-probs
            logps, ref_logps = logps / n, ref_logps / n
        chosen = (t["advantages"] > 0).view(-1, 2)
        idx = torch.arange(chosen.shape[0], device=chosen.device) * 2
        c = idx + (~chosen[:, 0]).long()  # row of each pair's chosen completion
        r = idx + chosen[:, 0].long()
        losses, cr, rr = dpo_loss(logps[c], logps[r], ref_logps[c], ref_logps[r],
                                  beta=self.beta, loss_type=self.loss_type)
        metrics = dict(batch.meta.get("rollout", {}))
        metrics.update({"rewards/chosen": float(cr.mean()), "rewards/rejected": float(rr.mean()),
                        "rewards/accuracies": float((cr > rr).float().mean())})
        return losses.sum(), metrics
