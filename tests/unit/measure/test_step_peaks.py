"""MemoryProbe's per-step peak (``memory/step_peak_bytes`` for the logger): recorded for tracked
steps only, the largest phase peak of that step, and the run's peak is the largest of them."""

from __future__ import annotations

import torch
from torch import nn

from memlab.measure.memory import MemoryProbe


def _step(probe: MemoryProbe, model: nn.Module, opt, index: int, tracked: bool, rows: int):
    x = torch.randn(rows, 64)
    with probe.step(index, tracked, [x]):
        with probe.phase("forward"):
            loss = model(x).pow(2).mean()
        with probe.phase("backward"):
            loss.backward()
        probe.micro_end()
        with probe.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_step_peaks_of_tracked_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    probe = MemoryProbe("cpu")
    probe.watch(model, opt)
    for index, (tracked, rows) in enumerate([(True, 8), (False, 8), (True, 512)]):
        _step(probe, model, opt, index, tracked, rows)
    assert probe.step_metrics(1) == {}
    small, big = (probe.step_metrics(i)["memory/step_peak_bytes"] for i in (0, 2))
    assert 0 < small < big  # 64x the rows: more activations at the larger step
    result = probe.result()
    assert result["tracked_steps"] == [0, 2]
    assert result["tracked_step_peaks"] == [small, big]
    assert result["peak_bytes"] == big == max(result["by_phase"].values())
