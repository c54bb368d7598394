"""Liger's knobs of sft / dpo / kto (memlab.method._liger): which kernels a run applies where,
and every refusal names its fix, before any model loads. The kernels themselves run in
tests/cpu_kernels (Triton's interpreter) and tests/gpu (CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf, open_dict

from memlab.config import Platform
from memlab.context import validate
from memlab.method._liger import LIGER_LOSS
from memlab.registry import ConfigErrors
from memlab_testing import FAST, compose

CPU_LIGER = Platform(assume_installed=frozenset({"liger_kernel"}))
INTERPRETER = dataclasses.replace(CPU_LIGER, triton_interpret=True)
LIGER = ["method.use_liger_kernel=true"]
ON_CPU = ["method.triton_interpret=true", "method.liger_kernels=[rope,fused_linear_cross_entropy]"]


def _validate(overrides: list[str], platform: Platform):
    cfg = compose(FAST + overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.to_container(cfg, resolve=True), platform=platform)


def _errors(overrides: list[str], platform: Platform) -> str:
    with pytest.raises(ConfigErrors) as e:
        _validate(overrides, platform)
    return str(e.value)


@pytest.mark.parametrize("method", ["sft", "dpo", "kto"])
@pytest.mark.slow
def test_a_cpu_run_with_liger_needs_the_opt_in_and_the_interpreter(method):
    m = [f"method={method}"]
    text = _errors(m + LIGER, CPU_LIGER)
    assert "needs a CUDA device" in text and "method.triton_interpret=true" in text
    assert "method.loss_impl=chunked" in text or method != "sft"
    # opted in, but the process did not start with TRITON_INTERPRET=1
    assert "TRITON_INTERPRET=1 memlab" in _errors(m + LIGER + ON_CPU, CPU_LIGER)
    ctx = _validate(m + LIGER + ON_CPU, INTERPRETER)
    assert ctx.method.liger_model_kernels() == ("rope",)
    assert ctx.method.liger_loss() and ctx.method.reads_head_weight(ctx) == LIGER_LOSS


def test_kernels_that_fail_in_the_interpreter_are_named_with_the_fix():
    text = _errors(LIGER + ["method.triton_interpret=true"], INTERPRETER)  # the default: all
    assert "rms_norm, swiglu fail inside Triton's interpreter" in text
    assert "method.liger_kernels=[rope,fused_linear_cross_entropy]" in text
    assert "must be one of" in _errors(LIGER + ON_CPU[:1] + ["method.liger_kernels=[ropes]"],
                                       INTERPRETER)
    assert "is empty" in _errors(LIGER + ON_CPU[:1] + ["method.liger_kernels=[]"], INTERPRETER)


@pytest.mark.slow
def test_on_cuda_every_kernel_and_no_interpreter():
    cuda = Platform.cuda_machine()
    ctx = _validate(["train.device=cuda", *LIGER], cuda)
    assert ctx.method.liger_model_kernels() == ("rope", "rms_norm", "swiglu")
    assert "a CPU test vehicle" in _errors(["train.device=cuda", *LIGER, *ON_CPU], cuda)
    # the kernels without the fused loss: the method's own loss, which reads no head weight
    # (the standard one) or does (the chunked one, the default)
    ctx = _validate(["train.device=cuda", *LIGER, "method.liger_kernels=[rms_norm]",
                     "method.loss_impl=standard"], cuda)
    assert not ctx.method.liger_loss() and ctx.method.reads_head_weight(ctx) is None
    ctx = _validate(["train.device=cuda", *LIGER, "method.liger_kernels=[rms_norm]"], cuda)
    assert ctx.method.reads_head_weight(ctx) == "method.loss_impl=chunked"
    assert ctx.method.liger_model_kernels() == ("rms_norm",)


def test_preference_loss_rules_apply_to_the_fused_loss_only():
    cuda = Platform.cuda_machine()
    o = ["train.device=cuda", "method=dpo", *LIGER, "method.loss_type=ipo"]
    assert "implements loss_type=sigmoid" in _errors(o, cuda)
    ctx = _validate(o + ["method.liger_kernels=[rope,rms_norm]"], cuda)  # DPO's own loss
    assert ctx.method.loss_type == "ipo" and not ctx.method.liger_loss()
    text = _errors(["train.device=cuda", "method=kto", *LIGER, "method.padding_free=true"], cuda)
    assert "method.padding_free=false" in text


def test_the_estimate_refuses_liger_with_the_fix():
    """Liger's Triton kernels cannot launch on the estimate's fake tensors."""
    from memlab.cli.compose import compose
    from memlab.estimate import EstimateOptions, estimate

    cfg, choices = compose(FAST + LIGER)
    out = estimate(cfg, EstimateOptions(device="cuda"), choices)
    assert out["status"] == "failed" and "method.use_liger_kernel=false" in out["error"]
