"""GKD's generalized JSD against the KL divergences it interpolates."""

from __future__ import annotations

import pytest
import torch

from memlab.method.gkd import generalized_jsd


def _kl(p_logits, q_logits, t=1.0):
    """KL(P || Q) per row, by hand."""
    lp, lq = (torch.log_softmax(x / t, -1) for x in (p_logits, q_logits))
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)


def test_endpoints_are_the_two_kls(logits):
    s, t = logits
    torch.testing.assert_close(generalized_jsd(s, t, 0.0, 0.9), _kl(t, s, 0.9))  # forward KL
    torch.testing.assert_close(generalized_jsd(s, t, 1.0, 0.9), _kl(s, t, 0.9))  # reverse KL


def test_jsd_is_zero_for_equal_distributions_and_symmetric_at_half(logits):
    s, t = logits
    assert generalized_jsd(s, s.clone(), 0.5).abs().max() < 1e-6
    torch.testing.assert_close(generalized_jsd(s, t, 0.5), generalized_jsd(t, s, 0.5))
    j = generalized_jsd(s, t, 0.3)
    assert (j > 0).all() and (j <= torch.log(torch.tensor(1 / 0.3)) + 1e-5).all()
    # by hand for beta=0.3: beta*KL(T||M) + (1-beta)*KL(S||M), M = 0.3 T + 0.7 S
    ps, pt = torch.softmax(s, -1), torch.softmax(t, -1)
    m = 0.3 * pt + 0.7 * ps
    ref = 0.3 * (pt * (pt / m).log()).sum(-1) + 0.7 * (ps * (ps / m).log()).sum(-1)
    torch.testing.assert_close(j, ref)
