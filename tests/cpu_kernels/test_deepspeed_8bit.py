"""``optimizer=adamw_8bit`` under ``distributed=deepspeed`` (ZeRO-2, 2 ranks on gloo, real
DeepSpeed on its CPU accelerator, bitsandbytes' 8-bit AdamW on CPU): memlab hands its optimizer
to the engine, which steps ZeRO's flat fp32 partitions with it, so each rank's optimizer state is
its fp32 master slice plus the slice's 8-bit moments - about 6 bytes per slice element, where
AdamW's fp32 moments make it 12. ``memlab estimate`` of the same configuration (the engine on
fake tensors over a fake process group) agrees with the real run, as it does for AdamW
(tests/integration/test_deepspeed.py)."""

from __future__ import annotations

import math

import pytest

from cpu_kernels.kernel_jobs import NEEDS_BNB
from integration.test_deepspeed import DS
from integration.test_estimate import REAL, TOLERANCE, _estimate, assert_agrees
from memlab._guards import has

pytestmark = [pytest.mark.cpu_kernels, NEEDS_BNB,
              pytest.mark.skipif(not has("deepspeed"), reason="needs the deepspeed extra")]

ESTIMATE_SHAPE = ["model.hidden_size=128", "model.intermediate_size=384", "model.num_layers=2",
                  "train.batch_size=2", "data.n_examples=32", "data.median_tokens=3000",
                  "train.device=cpu", "train.progress=false", "packing=bfd",
                  "method.max_length=256", "method.loss_on=all"]
"""Long documents cut at max_length, the loss on every token: the estimate's worst-case rows
(the shape DeepSpeed's agreement tests used for AdamW)."""
ZERO2 = [*ESTIMATE_SHAPE, *DS(2), "precision=fp32"]
"""The DeepSpeed agreement tests' shape at ZeRO-2 (fp32: an fp32 engine, exact numbers)."""


@pytest.fixture(scope="module")
def ds8(tmp_path_factory):
    """(the estimate, the real 2-rank run, AdamW's estimate), each made once for the module."""
    from memlab_testing import run_job

    root = tmp_path_factory.mktemp("deepspeed_8bit")
    est = _estimate(root, ZERO2 + ["optimizer=adamw_8bit"])
    real = run_job(root, ZERO2 + ["optimizer=adamw_8bit"] + REAL, fast=False, name="real")
    adamw = _estimate(root, ZERO2 + ["optimizer=adamw"])
    return est, real, adamw


def test_the_run_ends_ok_and_the_estimate_agrees(ds8):
    """The estimate's peak and each category at it within 1.5% of rank 0's (the rank it
    measures; the peak in the same phase), and its peak within 1.5% of the busiest rank's."""
    est, real, _ = ds8
    assert real["status"] == "ok", real["error"]
    assert real["choices"]["optimizer"] == "adamw_8bit"
    assert real["memory"]["distributed"]["zero_stage"] == 2
    assert any("rank 0 of 2 measured" in a for a in est["assumptions"]), est["assumptions"]
    assert_agrees("DeepSpeed ZeRO-2, 2 ranks, 8-bit AdamW (bitsandbytes on CPU)", est,
                  real["memory"], phases=("backward",))
    busiest = real["memory"]["peak_bytes_max_rank"]
    assert abs(est["peak_bytes"] - busiest) <= TOLERANCE * busiest, (est["peak_bytes"], busiest)


def test_each_rank_holds_8bit_moments_of_its_slice(ds8):
    """Measured on each rank: the fp32 master slice (4 bytes an element) and two uint8 moments
    of it (2 bytes, plus an fp32 absmax per 256-element block each, plus bitsandbytes' two
    256-entry code books), to the byte; under half of AdamW's 12 bytes an element at the same
    stage (its estimate, which the DeepSpeed agreement tests check against real AdamW runs)."""
    est, real, adamw = ds8
    assert real["status"] == "ok", real["error"]
    n = real["memory"]["params"]["trainable"] // 2  # the rank's slice of the flat fp32 partition
    eight_bit = 4 * n + 2 * n + 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4
    ranks = real["distributed"]["ranks"]
    assert [r["by_category"]["optimizer"] for r in ranks] == [eight_bit, eight_bit]
    # the master slice, two fp32 moments and torch AdamW's fp32 step count
    assert adamw["by_category"]["optimizer"] == 12 * n + 4
    assert eight_bit < 0.55 * adamw["by_category"]["optimizer"]
    assert est["by_category"]["optimizer"] == eight_bit
