"""Preference / reward-model losses on sequence log-probs and scalar rewards.

All functions take per-example tensors (sequence log-probs from
:func:`memlab.losses.token.sequence_logps`, or reward-head outputs) and return per-example
losses (or a scalar for :func:`bradley_terry_loss`) together with the detached implicit rewards
that trainers log. Definitions follow the papers and match Hugging Face TRL's conventions.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["bradley_terry_loss", "dpo_loss", "kto_kl_estimate", "kto_loss"]

DPOLossType = Literal["sigmoid", "ipo", "hinge"]


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: DPOLossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Direct Preference Optimization loss (and its IPO / hinge variants).

    With ``logits = (pi_c - pi_r) - (ref_c - ref_r)``:

    * ``"sigmoid"`` (DPO, Rafailov et al. 2023; conservative DPO when ``label_smoothing > 0``):
      ``-logsigmoid(beta * logits) * (1 - ls) - logsigmoid(-beta * logits) * ls``
    * ``"ipo"`` (Azar et al. 2023): ``(logits - 1 / (2 * beta)) ** 2``. IPO is defined on
      *length-averaged* log-probs: the caller must pass ``sum_logps / n_tokens`` (as TRL does)
      for all four inputs; with summed log-probs the target margin ``1/(2 beta)`` is meaningless.
    * ``"hinge"`` (SLiC, Zhao et al. 2023): ``relu(1 - beta * logits)``.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``[B]`` policy log-probs of the completions.
        ref_chosen_logps, ref_rejected_logps: ``[B]`` reference-model log-probs (no gradient is
            taken through them in practice; they are used as given).
        beta: inverse temperature / KL strength (> 0).
        loss_type: one of ``"sigmoid"``, ``"ipo"``, ``"hinge"``.
        label_smoothing: probability that a preference label is flipped (sigmoid only).

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``[B]``; the rewards are
        ``beta * (policy - ref)`` detached.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing only applies to loss_type='sigmoid', not {loss_type!r}")
    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1.0 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "ipo":
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * logits)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; use 'sigmoid', 'ipo' or 'hinge'")
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def kto_kl_estimate(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point: ``mean(policy - ref)`` clamped at 0, detached.

    The log-probs are of *mismatched* prompt/completion pairs (the caller pairs each prompt with
    another example's completion), so the mean estimates ``KL(policy || ref)`` on the batch. In
    distributed training, average the estimate over ranks before passing it to :func:`kto_loss`.
    """
    return (policy_kl_logps - ref_kl_logps).detach().float().mean().clamp(min=0)


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    is_desirable: Tensor,
    kl: Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Kahneman-Tversky Optimization loss (Ethayarajh et al. 2024).

    With ``r = policy - ref`` and ``z = max(kl, 0)`` (detached):

    * desirable examples: ``desirable_weight * (1 - sigmoid(beta * (r - z)))``
    * undesirable examples: ``undesirable_weight * (1 - sigmoid(beta * (z - r)))``

    Args:
        policy_logps, ref_logps: ``[B]`` sequence log-probs of each example's completion.
        is_desirable: ``[B]`` bool label of each example.
        kl: scalar reference point, usually :func:`kto_kl_estimate`.
        beta: KL strength (> 0).
        desirable_weight, undesirable_weight: class weights (lambda_D, lambda_U).

    Returns:
        ``(losses, rewards)``, each ``[B]``; ``rewards = beta * (policy - ref)`` detached. The
        batch loss is ``losses.mean()`` (TRL averages over all desirable and undesirable
        examples together).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if is_desirable.shape != policy_logps.shape:
        raise ValueError(
            f"is_desirable {tuple(is_desirable.shape)} and logps {tuple(policy_logps.shape)} differ"
        )
    z = torch.as_tensor(kl, dtype=policy_logps.dtype, device=policy_logps.device)
    z = z.detach().clamp(min=0)
    logratio = policy_logps - ref_logps
    desirable = is_desirable.bool()
    losses = torch.where(
        desirable,
        desirable_weight * (1.0 - torch.sigmoid(beta * (logratio - z))),
        undesirable_weight * (1.0 - torch.sigmoid(beta * (z - logratio))),
    )
    return losses, beta * logratio.detach()


def bradley_terry_loss(
    rewards_chosen: Tensor,
    rewards_rejected: Tensor,
    margin: Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> Tensor:
    """Pairwise reward-model loss: ``-logsigmoid(r_c - r_r - margin).mean()``.

    With ``center_rewards_coefficient`` the auxiliary term of Eisenstein et al. (2023)
    ``coef * mean((r_c + r_r) ** 2)`` is added, which keeps rewards centred at zero.

    Args:
        rewards_chosen, rewards_rejected: ``[B]`` (or ``[B, 1]``) scalar rewards.
        margin: optional ``[B]`` required reward gap per pair (Llama-2 style).
        center_rewards_coefficient: weight of the centring term (``None`` or 0: off).

    Returns:
        Scalar loss.
    """
    rc = rewards_chosen.reshape(-1)
    rr = rewards_rejected.reshape(-1)
    if rc.shape != rr.shape:
        raise ValueError(f"{rc.numel()} chosen rewards but {rr.numel()} rejected rewards")
    diff = rc - rr
    if margin is not None:
        m = margin.reshape(-1)
        if m.shape != rc.shape:
            raise ValueError(f"margin has {m.numel()} entries for {rc.numel()} pairs")
        diff = diff - m
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((rc + rr) ** 2).mean()
    return loss
