"""`memlab estimate` building blocks that need no training step: sizes, verdicts, the
ZeRO/FSDP post-processing, the CUDA rounding tracker, fake parameters and the QLoRA stand-in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memlab.estimate import CARDS, fmt_bytes, parse_bytes, verdict
from memlab.estimate.modes import estimate_tracker
from memlab.estimate.sharding import apply_sharding
from memlab.estimate.standins import QuantizedLinearStandin, fakeify

GiB, MiB = 1024**3, 1024**2


def test_parse_bytes_units():
    assert parse_bytes("24GiB") == 24 * GiB
    assert parse_bytes("24G") == 24 * GiB
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes("1.5T") == int(1.5 * 1024**4)
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_fmt_bytes():
    assert fmt_bytes(3 * GiB) == "3.00 GiB"
    assert fmt_bytes(1.5 * MiB) == "1.5 MiB"
    assert fmt_bytes(-2 * GiB) == "-2.00 GiB"
    assert fmt_bytes(10) == "10 B"


def test_verdict_fits_and_does_not_fit():
    cats = {"parameters": 10 * GiB, "gradients": 0, "optimizer": 20 * GiB, "activations": GiB,
            "other": 0}
    v = verdict(31 * GiB, 24 * GiB, cats)
    assert not v["fits"] and v["dominant"] == "optimizer"
    assert "over by 7.00 GiB" in v["text"] and "dominated by optimizer" in v["text"]
    v = verdict(20 * GiB, 24 * GiB, cats, overhead=GiB)
    assert v["fits"] and v["text"] == "fits with 3.00 GiB headroom"
    assert verdict(1, None, cats) is None


def test_cards_table_has_the_named_cards():
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "rtx4090", "l4", "a10g", "t4",
            "h200"} <= set(CARDS)
    assert CARDS["h200"]["mib"] > CARDS["h100-80gb"]["mib"] > CARDS["a100-40gb"]["mib"]


def _mem():
    fwd = {"parameters": 800, "gradients": 0, "optimizer": 1600, "activations": 500, "other": 8}
    bwd = {"parameters": 800, "gradients": 400, "optimizer": 1600, "activations": 300, "other": 8}
    opt = {"parameters": 800, "gradients": 800, "optimizer": 1700, "activations": 0, "other": 8}
    phases = {"forward": fwd, "backward": bwd, "optimizer": opt}
    by_phase = {k: sum(v.values()) for k, v in phases.items()}
    return {"peak_bytes": max(by_phase.values()), "by_category": opt, "by_phase": by_phase,
            "by_phase_category": phases, "peak_at": {"step": 1, "phase": "optimizer"}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharding_divides_what_each_zero_stage_shards(stage):
    mem, notes = _mem(), []
    out = apply_sharding(mem, 8, stage, {"largest_bytes": 16, "largest_grad_bytes": 8}, notes)
    opt = out["by_phase_category"]["optimizer"]
    assert opt["optimizer"] == 1700 // 8 + (1700 % 8 > 0)
    assert opt["gradients"] == (100 if stage >= 2 else 800)
    assert opt["parameters"] == (100 if stage >= 3 else 800)
    fwd = out["by_phase_category"]["forward"]
    assert fwd["parameters"] == (100 + 2 * 16 if stage == 3 else 800)  # two gathered units
    assert fwd["activations"] == 500  # activations are per rank
    assert out["peak_bytes"] == max(out["by_phase"].values())
    assert sum(out["by_category"].values()) == out["peak_bytes"]
    assert notes and f"zero_stage={stage}" in notes[0]


def test_sharding_world_one_is_identity_and_ddp_doubles_gradients():
    mem = _mem()
    assert apply_sharding(mem, 1, 3) is mem
    ddp = apply_sharding(mem, 4, 0)
    assert ddp["by_phase_category"]["optimizer"]["gradients"] == 1600


def test_rounding_tracker_rounds_each_storage_to_512_bytes():
    def peak(tracker):
        with tracker:
            a = torch.empty(10)  # 40 B -> 512 B
            b = torch.empty(300)  # 1200 B -> 1536 B
            del a, b
        return tracker._peak_mem[torch.device("cpu")]

    assert peak(estimate_tracker(0)) == 40 + 1200
    assert peak(estimate_tracker(512)) == 512 + 1536


def test_fakeify_allocates_nothing_and_keeps_ties():
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    with torch.device("meta"):
        m = nn.Sequential(nn.Embedding(50_000, 4096), nn.Linear(4096, 50_000, bias=False))
    m[1].weight = m[0].weight  # tied
    m[0].weight.requires_grad_(False)
    fakeify(m, FakeTensorMode())  # 2 x 800 MB if it allocated
    w0, w1 = m[0].weight, m[1].weight
    assert is_fake(w0) and w0 is w1 and w0.device.type == "cpu"
    assert isinstance(w0, nn.Parameter) and not w0.requires_grad


def test_quantized_standin_stores_weights_like_bitsandbytes():
    lin = nn.Linear(256, 512, bias=False, device="meta")
    q4 = QuantizedLinearStandin(lin, 4, double_quant=False, compute_dtype=torch.bfloat16)
    n = 256 * 512
    assert q4.weight.dtype == torch.uint8 and q4.weight.numel() == n // 2
    assert q4.quant_state.numel() == (n // 64) * 4 + 16 * 4  # fp32 absmax per block + codes
    q4d = QuantizedLinearStandin(lin, 4, double_quant=True, compute_dtype=torch.bfloat16)
    assert q4d.quant_state.numel() < q4.quant_state.numel()
    q8 = QuantizedLinearStandin(lin, 8, double_quant=False, compute_dtype=torch.float16)
    assert q8.weight.dtype == torch.int8 and q8.weight.numel() == n
    assert not q8.weight.requires_grad and q8.logical_numel == n
