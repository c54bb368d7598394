"""What every precision option answers alike (:class:`memlab.precision.base.Dtypes`): fp16's loss
scaler, no autocast without a compute dtype, and bf16 refused on a GPU without it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from memlab.config import Platform
from memlab.context import validate
from memlab.precision.bf16 import Bf16
from memlab.precision.fp16_mixed import Fp16Mixed
from memlab.precision.fp32 import Fp32
from memlab.registry import ConfigErrors
from memlab_testing import FAST, compose, with_fast


def test_only_fp16_mixed_scales_its_loss():
    scaler = Fp16Mixed().grad_scaler("cpu")
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert Fp32().grad_scaler("cpu") is None and Bf16().grad_scaler("cpu") is None


def test_a_precision_without_a_compute_dtype_runs_without_autocast():
    for option in (Fp32(), Bf16()):
        assert isinstance(option.autocast("cpu"), contextlib.nullcontext)


@pytest.mark.parametrize("name", ["bf16", "bf16_mixed"])
def test_bf16_is_refused_on_a_gpu_without_it(name):
    from omegaconf import open_dict

    cfg = compose(with_fast([f"precision={name}", "train.device=cuda"], FAST))
    with open_dict(cfg):
        del cfg["hydra"]
    with pytest.raises(ConfigErrors, match="no bf16 support; use fp16_mixed"):
        validate(cfg, platform=Platform(cuda=True, gpus=1, bf16=False))
