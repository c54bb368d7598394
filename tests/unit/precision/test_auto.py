"""precision=auto, the default: bf16 mixed precision (TRL's default, ``bf16=True``) where the
device has bf16 kernels (a GPU with them, a CPU with oneDNN's), fp32 where it has not. It
resolves once, when the run is validated: every rule and every builder sees the option it
stands for, and a default run trains exactly as the explicit option does."""

from __future__ import annotations

import pytest

from memlab.config import Platform
from memlab.context import validate
from memlab.measure.summary import format_table
from memlab.precision.auto import Auto
from memlab.precision.bf16_mixed import Bf16Mixed
from memlab.precision.fp32 import Fp32
from memlab_testing import FAST, compose, with_fast

GPU_WITHOUT_BF16 = Platform(cuda=True, gpus=1, bf16=False)
CPU_WITH_BF16 = Platform(cpu_bf16=True)


def _ctx(overrides: list[str], platform: Platform | None = None):
    from omegaconf import open_dict

    cfg = compose(overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(cfg, platform=platform)


def test_auto_is_the_default():
    assert compose([]).precision.name == "auto"
    assert "precision=fp32" in FAST  # the tests' own runs pin fp32 (see memlab_testing.FAST)


@pytest.mark.parametrize(("device", "platform", "expected"), [
    ("cpu", CPU_WITH_BF16, Bf16Mixed),
    ("cpu", Platform(cpu_bf16=False), Fp32),
    ("cuda", Platform.cuda_machine(gpus=1), Bf16Mixed),
    ("cuda", GPU_WITHOUT_BF16, Fp32),
    ("cuda", Platform(cuda=True, gpus=1, bf16=True, cpu_bf16=False), Bf16Mixed),
])
def test_auto_resolves_for_the_device(device, platform, expected):
    chosen = Auto().resolved(device, platform)
    assert type(chosen) is expected
    assert chosen.resolved(device, platform) is chosen  # a concrete option stands for itself


def test_the_run_context_holds_the_resolved_option():
    ctx = _ctx(["train.device=auto"], platform=CPU_WITH_BF16)
    assert ctx.device == "cpu" and type(ctx.precision) is Bf16Mixed
    assert ctx.precision.compute_dtype_name() == "bfloat16"
    on_old_gpu = _ctx(["train.device=auto"], platform=GPU_WITHOUT_BF16)
    assert on_old_gpu.device == "cuda" and type(on_old_gpu.precision) is Fp32
    # a bf16-only attention backend is checked against the resolved option: auto on a GPU
    # without bf16 is fp32, which flash attention refuses, naming the precision to choose
    with pytest.raises(Exception, match="precision=fp32 computes in float32"):
        _ctx(["train.device=auto", "attention=flash_attention_2"], platform=GPU_WITHOUT_BF16)


def test_memlab_cpu_bf16_overrides_the_detection(monkeypatch):
    """MEMLAB_CPU_BF16=1|0 decides what precision=auto is on any CPU; another value is refused
    with the configuration; the run's record says it was set (device.cpu_bf16_env)."""
    from memlab.measure.summary import device_info

    for value, expected in (("1", Bf16Mixed), ("0", Fp32)):
        monkeypatch.setenv("MEMLAB_CPU_BF16", value)
        platform = Platform.detect()
        assert platform.cpu_bf16 is (value == "1") and platform.cpu_bf16_env == value
        assert type(_ctx(["train.device=cpu"]).precision) is expected
        assert device_info("cpu")["cpu_bf16_env"] == value
    monkeypatch.setenv("MEMLAB_CPU_BF16", "yes")
    with pytest.raises(Exception, match="MEMLAB_CPU_BF16='yes': set it to 1"):
        _ctx(["train.device=cpu"])
    monkeypatch.delenv("MEMLAB_CPU_BF16")
    assert Platform.detect().cpu_bf16_env is None and "cpu_bf16_env" not in device_info("cpu")


@pytest.mark.pipeline
@pytest.mark.auto_precision("the default run as this machine's CPU resolves it, against the "
                            "option it stands for")
def test_a_default_run_trains_as_the_option_auto_stands_for_here(job):
    """On this machine's CPU: the same loss curve, to the bit, as the explicit option, and not
    the other one's; the record keeps the choice and says what it stood for."""
    here = Auto().resolved("cpu", Platform.detect()).name
    other = "fp32" if here == "bf16_mixed" else "bf16_mixed"
    base = [o for o in with_fast([]) if not o.startswith("precision=")]
    auto = job(base, fast=False)
    same = job(base + [f"precision={here}"], fast=False)
    different = job(base + [f"precision={other}"], fast=False)
    assert auto["choices"]["precision"] == "auto" and auto["resolved"] == {"precision": here}
    assert same["resolved"] == {} and different["resolved"] == {}
    assert auto["train"]["loss_curve"] == same["train"]["loss_curve"]
    assert auto["train"]["loss_curve"] != different["train"]["loss_curve"]
    assert f"precision=auto ({here})" in format_table(auto)
