"""Packed preference runs end to end: the command issue 17 starts from, and the same training
as a padded run across gradient accumulation and 2 ranks (ddp, fsdp2; gloo on CPU).

Same training: 8 pairs, each optimizer step covering all of them: padded 4 pairs x 2
micro-batches; packed (bfd_split + share_prompt, 3 rows per micro-batch: 4 micro-batches here)
x 4 micro-batches in one process, and 2 ranks x 2 micro-batches. DPO's loss is the mean over
the step's pairs, so every run takes the same steps: loss curves within 1e-4 relative (fp32;
the per-micro-batch sums differ in order only, measured ~1e-6).
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.integration

PAIRS = ["method=dpo", "method.max_length=384", "method.max_prompt_length=128",
         "data.n_examples=8", "train.steps=3", "measure.memory_steps=1"]
PACKED = PAIRS + ["packing=bfd_split", "method.share_prompt=true", "train.batch_size=3"]


def test_the_introduction_command_runs(job):
    """``python -m memlab method=dpo packing=bfd_split`` (with the small test model)."""
    s = job(["method=dpo", "packing=bfd_split"])
    assert s["status"] == "ok", s["error"]
    d = s["data"]
    assert d["units_split"] > 0  # max_length=128: some pairs need two rows
    assert d["rows"] <= d["micro_batches"] * 2 and d["tokens_dropped"] > 0  # per-sequence cuts
    assert 0.5 < d["fill_ratio"] <= 1.0
    assert all(math.isfinite(x) for x in s["train"]["loss_curve"])


def test_packed_shared_runs_train_like_the_padded_run(job):
    padded = job(PAIRS + ["train.batch_size=4", "train.grad_accum=2"])
    packed = job(PACKED + ["train.grad_accum=4"])
    ddp = job(PACKED + ["distributed=ddp", "distributed.nproc=2", "train.grad_accum=2"])
    fsdp = job(PACKED + ["distributed=fsdp2", "distributed.nproc=2", "train.grad_accum=2"])
    for s in (padded, packed, ddp, fsdp):
        assert s["status"] == "ok", s["error"]
    assert packed["data"]["micro_batches"] == 4  # so that a step of 4 covers every pair
    curve = padded["train"]["loss_curve"]
    assert curve[0] > curve[-1]  # it trains
    for s in (packed, ddp, fsdp):
        assert s["train"]["loss_curve"] == pytest.approx(curve, rel=1e-4)
        assert s["train"]["final_metrics"]["rewards/accuracies"] == pytest.approx(
            padded["train"]["final_metrics"]["rewards/accuracies"])
    # the shared prompt is stored once: fewer tokens per pair, less padding
    assert packed["data"]["tokens_in"] < padded["data"]["tokens_in"]
    assert packed["data"]["padding_fraction"] < padded["data"]["padding_fraction"]
