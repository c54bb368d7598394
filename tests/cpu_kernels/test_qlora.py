"""``peft=qlora`` on CPU through bitsandbytes (4-bit NF4, float32 compute): the estimate's
4-bit base is bitsandbytes' own and agrees with the real run to the byte, the parameters
category holds the 4-bit weights and their quantization state, training saves and resumes
exactly, a repack for inference cannot take the input gradient away, and the loss is LoRA's
on the dequantized base."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from cpu_kernels.kernel_jobs import NEEDS_BNB
from integration.test_estimate import ALL_LABELLED, LEN, REAL, SHAPE, _estimate, assert_agrees

pytestmark = [pytest.mark.cpu_kernels, NEEDS_BNB]

QLORA = ["peft=qlora", "peft.compute_dtype=float32"]  # nf4, double quantization (the default)


def nf4_bytes(out_features: int, in_features: int) -> int:
    """What bitsandbytes keeps for one NF4 weight with double quantization: two weights a byte,
    a uint8 scale per 64-weight block, a float32 scale per 256 blocks, the float32 offset,
    the 16-entry code book and the 256-entry code book of the scales."""
    n = out_features * in_features
    blocks = math.ceil(n / 64)
    return n // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 + 4 * 16 + 4 * 256


def test_estimate_of_the_4bit_base_is_bitsandbytes_own_and_exact(job, tmp_path):
    """Packed rows of one 256-token document (test_estimate.py's worst-case data): the estimate
    (bitsandbytes' layers on fake tensors) and the real run agree to the byte in every
    category; the parameters are the 4-bit linear layers plus the float32 rest."""
    overrides = SHAPE + ["packing=bfd", *QLORA, *ALL_LABELLED, *LEN]
    est = _estimate(tmp_path, overrides)
    assert any("laid out and computed by bitsandbytes itself" in a for a in est["assumptions"])
    real = job(overrides + REAL, fast=False)
    assert real["status"] == "ok", real["error"]
    assert_agrees("packed bfd qlora (bitsandbytes on CPU)", est, real["memory"])
    assert est["by_category"] == real["memory"]["by_category"]  # to the byte
    hidden, inter, layers, vocab, kv = 128, 384, 2, 4096, 64  # SHAPE; 2 kv heads of 32
    linears = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
               (inter, hidden), (inter, hidden), (hidden, inter)]
    four_bit = layers * sum(nf4_bytes(o, i) for o, i in linears)
    lora = layers * 16 * 4 * sum(o + i for o, i in linears)  # r=16 A and B, float32
    rest = 4 * (2 * vocab * hidden + (2 * layers + 1) * hidden)  # embeddings, head, norms
    assert real["memory"]["by_category"]["parameters"] == four_bit + lora + rest


@pytest.mark.parametrize("double_quant", [False, True])
def test_the_model_of_the_4bit_layout_is_bitsandbytes_own(double_quant):
    """Where bitsandbytes is missing, the estimate models a 4-bit layer; the bytes it models
    are those bitsandbytes lays out (weight + quantization state)."""
    from torch import nn

    from memlab.estimate.standins import Bnb4bitStandin, QuantizedLinearStandin

    def nbytes(mod):
        return sum(p.numel() * p.element_size() for p in mod.parameters())

    lin = nn.Linear(384, 128, bias=False, device="meta")
    model = QuantizedLinearStandin(lin, 4, double_quant, torch.bfloat16)
    measured = Bnb4bitStandin(lin, "nf4", double_quant, torch.bfloat16)
    assert nbytes(model) == nbytes(measured)
    if double_quant:
        assert nbytes(measured) == nf4_bytes(128, 384)


def test_qlora_trains_saves_and_resumes_exactly(job):
    """Saving the adapter (and the base merged with it, from the full-precision base) in the
    middle of a run; resuming from it gives the straight run's curve."""
    o = QLORA + ["train.steps=4", "train.lr=1e-2"]
    saved = job(o + ["train.save_every=2", "train.save_merged=true"])
    assert saved["status"] == "ok", saved["error"]
    losses = saved["train"]["loss_curve"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    ckpt = f"{saved['run_dir']}/checkpoints/step_000002"
    from pathlib import Path

    files = {p.name for p in Path(ckpt).iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert (Path(ckpt) / "merged" / "model.safetensors").is_file()
    resumed = job(o + [f"train.resume_from={ckpt}"])
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["train"]["loss_curve"] == losses
    assert resumed["train"]["curves"] == saved["train"]["curves"]


def test_qlora_is_lora_on_the_dequantized_base(job, tmp_path):
    """The same run with LoRA on a base whose linear weights are the 4-bit weights dequantized
    (the float32 values bitsandbytes computes with) gives the same losses; LoRA on the original
    base does not (quantization changed the base)."""
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from memlab.data.assets import load_tokenizer
    from memlab.model.base import seeded
    from memlab.model.tiny import Tiny

    tok = load_tokenizer()
    cfg = Tiny(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2).hf_config(tok)  # memlab_testing.FAST's model
    with seeded(0):  # model=tiny's init at train.seed=0
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "base")
    q = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", device_map={"": "cpu"}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    state = plain.state_dict()
    n = 0
    for name, mod in q.named_modules():
        w = getattr(mod, "weight", None)
        if getattr(w, "quant_state", None) is not None:
            state[f"{name}.weight"] = bnbf.dequantize_4bit(w.data, w.quant_state).float()
            n += 1
    assert n == 2 * 7
    plain.load_state_dict(state)
    plain.save_pretrained(tmp_path / "dequantized")
    tok.save_pretrained(tmp_path / "dequantized")
    o = ["train.steps=3", "train.lr=1e-2"]
    qlora = job(o + QLORA)
    lora_dq = job(o + ["peft=lora", "model=hf", f"model.name_or_path={tmp_path / 'dequantized'}",
                       "model.local_files_only=true"])
    lora = job(o + ["peft=lora"])
    for s in (qlora, lora_dq, lora):
        assert s["status"] == "ok", s["error"]
    assert qlora["train"]["loss_curve"] == pytest.approx(lora_dq["train"]["loss_curve"],
                                                         rel=1e-5)
    gap = abs(qlora["train"]["loss_curve"][0] - lora["train"]["loss_curve"][0])
    assert gap > 1e-4  # 4-bit weights are not the original ones


def test_a_no_grad_pass_keeps_the_input_gradient(tmp_path):
    """bitsandbytes repacks a CPU 4-bit layer for a fused kernel without autograd on its first
    eval, no-grad forward (generation, a reference pass); memlab turns that off
    (memlab.measure.patches.keep_4bit_training_layout), so training afterwards still
    backpropagates through the layer."""
    import bitsandbytes as bnb

    from memlab.measure.patches import keep_4bit_training_layout

    def input_grad_after_a_no_grad_pass(keep: bool) -> torch.Tensor | None:
        torch.manual_seed(0)
        layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32)
        layer.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False)
        layer = layer.to("cpu")
        if keep:
            assert keep_4bit_training_layout(torch.nn.Sequential(layer)) == 1
        x = torch.randn(3, 64)
        layer.eval()
        with torch.no_grad():
            layer(x)
        layer.train()
        x.requires_grad_()
        with warnings.catch_warnings():  # bitsandbytes' fused kernel: "no autograd kernel"
            warnings.simplefilter("ignore")
            layer(x).sum().backward()
        return x.grad

    kept = input_grad_after_a_no_grad_pass(keep=True)
    assert kept is not None and kept.abs().sum() > 0
    if bnb.nn.Linear4bit(8, 8).support_avx512bf16_for_cpu:  # this CPU has the fused kernel
        assert input_grad_after_a_no_grad_pass(keep=False) is None  # what memlab prevents


def test_qlora_in_backward_trains_as_the_standard_step(job):
    """optimizer.in_backward=true on the 4-bit base (no clipping): each adapter weight stepped
    in its gradient hook gives the standard step's loss curve and adapters, to 1e-5; its
    optimizer phase holds no gradient, the standard step's every adapter gradient."""
    from memlab.trainer.checkpoint import read_weights

    o = QLORA + ["train.max_grad_norm=null", "train.steps=3", "train.lr=1e-2",
                 "train.save_final=true", "measure.memory_steps=1"]
    std, inb = job(o), job(o + ["optimizer.in_backward=true"])
    assert std["status"] == inb["status"] == "ok", (std["error"], inb["error"])
    losses = std["train"]["loss_curve"]
    assert losses[-1] < losses[0]  # it trained
    assert inb["train"]["loss_curve"] == pytest.approx(losses, abs=1e-5)
    w_std = read_weights(std["train"]["checkpoint"])
    w_inb = read_weights(inb["train"]["checkpoint"])
    assert w_std.keys() == w_inb.keys() and all("lora_" in k for k in w_std)
    assert max(float((w_std[k] - w_inb[k]).abs().max()) for k in w_std) <= 1e-5
    adapters = 4 * std["memory"]["models"]["policy"]["trainable"]  # float32 gradients
    assert std["memory"]["by_phase_category"]["optimizer"]["gradients"] == adapters
    assert inb["memory"]["by_phase_category"]["optimizer"]["gradients"] == 0
