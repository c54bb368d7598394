"""Preference / reward losses against closed forms computed with ``math`` on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch

from memlab.losses import bradley_terry_loss, dpo_loss, kto_kl_estimate, kto_loss


def _logsig(x: float) -> float:
    """log(sigmoid(x)) = -log(1 + exp(-x))."""
    return -math.log1p(math.exp(-x))


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# (policy_chosen, policy_rejected, ref_chosen, ref_rejected) per example; logits by hand:
#   (-1 - -3) - (-1.5 - -2) = 2 - 0.5 = 1.5
#   (-4 - -2) - (-3 - -3)   = -2
#   (-0.5 - -20) - (-1 - -2) = 19.5 - 1 = 18.5
ROWS = [(-1.0, -3.0, -1.5, -2.0), (-4.0, -2.0, -3.0, -3.0), (-0.5, -20.0, -1.0, -2.0)]
LOGITS = [1.5, -2.0, 18.5]


def _dpo_inputs(requires_grad: bool = False) -> list[torch.Tensor]:
    cols = list(zip(*ROWS))
    return [torch.tensor(c, dtype=torch.float64, requires_grad=requires_grad) for c in cols]


def test_logits_by_hand_match_rows() -> None:
    for (pc, pr, rc, rr), lg in zip(ROWS, LOGITS):
        assert (pc - pr) - (rc - rr) == lg


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_dpo_sigmoid_closed_form(beta: float, ls: float) -> None:
    losses, ch, rj = dpo_loss(*_dpo_inputs(), beta=beta, loss_type="sigmoid", label_smoothing=ls)
    expected = [-(1 - ls) * _logsig(beta * x) - ls * _logsig(-beta * x) for x in LOGITS]
    assert losses.tolist() == pytest.approx(expected, rel=1e-12)
    assert ch.tolist() == pytest.approx([beta * (pc - rc) for pc, _, rc, _ in ROWS], rel=1e-12)
    assert rj.tolist() == pytest.approx([beta * (pr - rr) for _, pr, _, rr in ROWS], rel=1e-12)


def test_dpo_sigmoid_gradient_closed_form() -> None:
    beta = 0.1
    pc, pr, rc, rr = _dpo_inputs(requires_grad=True)
    losses, ch, rj = dpo_loss(pc, pr, rc, rr, beta=beta)
    losses.sum().backward()
    # d/dpc [-logsigmoid(beta * x)] = -beta * sigmoid(-beta * x); d/dpr is the negative.
    expected = [-beta * _sig(-beta * x) for x in LOGITS]
    assert pc.grad.tolist() == pytest.approx(expected, rel=1e-12)
    assert pr.grad.tolist() == pytest.approx([-g for g in expected], rel=1e-12)
    assert not ch.requires_grad and not rj.requires_grad


def test_dpo_ipo_closed_form() -> None:
    beta = 0.1  # target margin 1 / (2 * 0.1) = 5
    losses, _, _ = dpo_loss(*_dpo_inputs(), beta=beta, loss_type="ipo")
    assert losses.tolist() == pytest.approx([(1.5 - 5) ** 2, (-2 - 5) ** 2, (18.5 - 5) ** 2])
    assert losses.tolist() == pytest.approx([12.25, 49.0, 182.25])


def test_dpo_hinge_closed_form() -> None:
    losses, _, _ = dpo_loss(*_dpo_inputs(), beta=0.1, loss_type="hinge")
    # relu(1 - 0.15), relu(1 + 0.2), relu(1 - 1.85)
    assert losses.tolist() == pytest.approx([0.85, 1.2, 0.0])


def test_dpo_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*_dpo_inputs(), loss_type="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*_dpo_inputs(), beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*_dpo_inputs(), loss_type="ipo", label_smoothing=0.1)


def test_kto_closed_form() -> None:
    beta, kl, wd, wu = 0.2, 0.5, 1.0, 1.5
    policy = [-1.0, -2.0, -3.0, -0.5]
    ref = [-2.0, -2.5, -1.0, -0.5]
    desirable = [True, False, True, False]
    losses, rewards = kto_loss(
        torch.tensor(policy, dtype=torch.float64),
        torch.tensor(ref, dtype=torch.float64),
        torch.tensor(desirable),
        torch.tensor(kl),
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
    )
    expected = []
    for p, r, d in zip(policy, ref, desirable):
        lr = p - r
        expected.append(
            wd * (1 - _sig(beta * (lr - kl))) if d else wu * (1 - _sig(beta * (kl - lr)))
        )
    assert losses.tolist() == pytest.approx(expected, rel=1e-12)
    assert rewards.tolist() == pytest.approx([beta * (p - r) for p, r in zip(policy, ref)])


def test_kto_kl_is_clamped_and_detached() -> None:
    policy = torch.tensor([-1.0, -4.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0, -3.0], dtype=torch.float64)
    kl = torch.tensor(-0.7, dtype=torch.float64, requires_grad=True)  # negative -> 0
    losses, rewards = kto_loss(policy, ref, torch.tensor([True, False]), kl, beta=1.0)
    assert losses.tolist() == pytest.approx([1 - _sig(1.0), 1 - _sig(1.0)], rel=1e-12)
    losses.sum().backward()
    assert kl.grad is None
    # d/dp (1 - sigmoid(p - r)) = -s(1-s) at p - r = 1; undesirable: +s(1-s) at r - p = 1
    s = _sig(1.0)
    assert policy.grad.tolist() == pytest.approx([-s * (1 - s), s * (1 - s)], rel=1e-12)
    assert not rewards.requires_grad


def test_kto_accepts_float_kl() -> None:
    losses, _ = kto_loss(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([True]), 0.0)
    assert losses.tolist() == pytest.approx([0.5])


def test_kto_kl_estimate() -> None:
    policy = torch.tensor([-1.0, -2.0, -6.0], requires_grad=True)
    ref = torch.tensor([-2.0, -2.5, -6.0])
    kl = kto_kl_estimate(policy, ref)
    assert kl.item() == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert not kl.requires_grad and kl.dim() == 0
    assert kto_kl_estimate(ref, policy).item() == 0.0  # mean -0.5 clamped


def test_bradley_terry_closed_form() -> None:
    rc, rr, m = [2.0, -1.0, 0.5], [1.0, 0.5, 0.5], [0.5, 0.0, 1.0]
    plain = bradley_terry_loss(torch.tensor(rc), torch.tensor(rr))
    assert plain.item() == pytest.approx(-sum(_logsig(a - b) for a, b in zip(rc, rr)) / 3)
    with_margin = bradley_terry_loss(torch.tensor(rc), torch.tensor(rr), margin=torch.tensor(m))
    expected_margin = -sum(_logsig(a - b - c) for a, b, c in zip(rc, rr, m)) / 3
    assert with_margin.item() == pytest.approx(expected_margin, rel=1e-6)
    centred = bradley_terry_loss(
        torch.tensor(rc).unsqueeze(1),  # reward heads give [B, 1]
        torch.tensor(rr).unsqueeze(1),
        margin=torch.tensor(m),
        center_rewards_coefficient=0.01,
    )
    penalty = 0.01 * sum((a + b) ** 2 for a, b in zip(rc, rr)) / 3  # (9 + 0.25 + 1) / 3 * 0.01
    assert centred.item() == pytest.approx(expected_margin + penalty, rel=1e-6)


def test_bradley_terry_gradient_and_shapes() -> None:
    rc = torch.tensor([1.0, 0.0], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.0, 0.0], dtype=torch.float64, requires_grad=True)
    bradley_terry_loss(rc, rr).backward()
    # d/drc [-logsigmoid(d)] / B = -sigmoid(-d) / B
    assert rc.grad.tolist() == pytest.approx([-_sig(-1.0) / 2, -0.5 / 2], rel=1e-12)
    assert rr.grad.tolist() == pytest.approx([_sig(-1.0) / 2, 0.5 / 2], rel=1e-12)
    with pytest.raises(ValueError):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError):
        bradley_terry_loss(torch.zeros(3), torch.zeros(3), margin=torch.zeros(2))
