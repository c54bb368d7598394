"""``optimizer=adamw_8bit`` on CPU through bitsandbytes: a one-layer model's loss curve stays
within 0.5% of fp32 AdamW's over 50 steps (measured: 0.05%; docs/optimizers.md); the tracker
books the uint8 states, their per-block absmax and the two code books as ``optimizer``, to the
byte; ``embedding_states_32bit`` keeps the embedding's states in fp32; stepping inside backward
gives the standard step's parameters; the state resumes through memlab's checkpoint files; and
``memlab estimate`` agrees with a real run to the byte in every category."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cpu_kernels.kernel_jobs import NEEDS_BNB
from integration.test_estimate import ALL_LABELLED, LEN, REAL, SHAPE, _estimate, assert_agrees
from unit.optimizer.steps import (
    ctx_of,
    max_param_diff,
    resumed_equals_uninterrupted,
    train_both_ways,
)

pytestmark = [pytest.mark.cpu_kernels, NEEDS_BNB]

TOLERANCE = 0.005
"""8-bit AdamW's loss against fp32 AdamW's, relative, at every one of 50 steps."""


def _bnb(ps, lr=1e-2):
    from memlab.optimizer._bnb import adamw_class

    return adamw_class()(ps, lr=lr, optim_bits=8, min_8bit_size=4096, weight_decay=0.1)


def _curve(make) -> list[float]:
    """50 steps of a one-layer classifier (a [64, 256] weight: 8-bit states) on fixed data."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 256, generator=g)
    y = (x @ torch.randn(256, 64, generator=g)).argmax(-1)
    opt = make(list(layer.parameters()))
    losses = []
    for _ in range(50):
        i = torch.randint(0, 1024, (64,), generator=g)
        loss = nn.functional.cross_entropy(layer(x[i]), y[i])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def test_loss_curve_within_tolerance_of_fp32_adamw():
    fp32 = _curve(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1))
    int8 = _curve(lambda ps: _bnb(ps, lr=1e-3))
    assert fp32[-1] < 0.9 * fp32[0]  # it trains
    worst = max(abs(a - b) / a for a, b in zip(fp32, int8, strict=True))
    assert 0 < worst <= TOLERANCE, worst  # quantized (not fp32 by accident), and close


def test_tracker_books_states_absmax_and_code_books_as_optimizer():
    from memlab.measure.memory import MemoryProbe

    ctx = ctx_of("optimizer=adamw_8bit")
    model = nn.Sequential(nn.Embedding(64, 128), nn.Linear(128, 64))
    opt = ctx.optimizer.build(list(model.parameters()), ctx, model)
    model(torch.arange(8)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = opt.state[model[1].weight]
    assert state["state1"].dtype == state["state2"].dtype == torch.uint8
    probe = MemoryProbe("cpu")
    probe.watch(model, opt)
    with probe.step(1, True), probe.phase("forward"):
        model(torch.arange(8)).sum()

    def eight_bit(n: int) -> int:  # two uint8 states, an fp32 absmax per 256-value block each
        return 2 * n + 2 * 4 * math.ceil(n / 256)

    books = 2 * 256 * 4  # qmap1 / qmap2, shared by every 8-bit parameter
    small = 2 * 4 * 64  # the bias (< min_8bit_size): two fp32 states
    expect = eight_bit(64 * 128) * 2 + books + small
    assert probe.result()["by_category"]["optimizer"] == expect

    wide = ctx_of("optimizer=adamw_8bit", "optimizer.embedding_states_32bit=true")
    opt = wide.optimizer.build(list(model.parameters()), wide, model)
    model(torch.arange(8)).sum().backward()
    opt.step()
    assert opt.state[model[0].weight]["state1"].dtype == torch.float32
    assert opt.state[model[1].weight]["state1"].dtype == torch.uint8


def test_in_backward_equals_the_standard_step():
    std, inb, _, _ = train_both_ways(_bnb, model=_wide_tied())
    assert max_param_diff(std, inb) <= 1e-5


def _wide_tied():
    from unit.optimizer.steps import Tied

    return Tied(vocab=48, dim=96)  # 48 x 96 and 96 x 192 weights: 8-bit states


def test_state_resumes_through_the_checkpoint_files(tmp_path):
    assert resumed_equals_uninterrupted(_bnb, tmp_path) == 0.0


def test_estimate_agrees_with_the_real_run(job, tmp_path):
    overrides = SHAPE + ["packing=bfd", "optimizer=adamw_8bit", *ALL_LABELLED, *LEN]
    est = _estimate(tmp_path, overrides)
    real = job(overrides + REAL, fast=False)
    assert real["status"] == "ok", real["error"]
    assert_agrees("packed bfd 8-bit AdamW (bitsandbytes on CPU)", est, real["memory"])
    assert est["by_category"]["optimizer"] == real["memory"]["by_category"]["optimizer"]
