"""GPU-only paths, run on a CUDA machine (skipped elsewhere): each technique trains, matches the
plain sdpa run's loss within a stated tolerance, and moves the allocator's peak the right way."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = ["train.device=cuda", "measure.memory_steps=all", "train.steps=3"]


def _has(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


def test_cuda_run_reports_allocator_peaks(job):
    s = job(CUDA)
    assert s["status"] == "ok", s["error"]
    m = s["memory"]
    assert m["source"] == "cuda_allocator"
    assert m["cuda"]["peak_reserved_bytes"] >= m["cuda"]["peak_allocated_bytes"] > 0
    assert sum(m["by_category"].values()) == m["peak_bytes"]


def test_offload_activations_lowers_cuda_peak(job):
    big = CUDA + ["model.hidden_size=512", "model.intermediate_size=2048", "model.num_layers=4",
                  "method.max_length=1024", "train.batch_size=4",
                  "train.gradient_checkpointing=false"]
    base = job(big)
    off = job(big + ["offload=activations"])
    assert off["status"] == "ok", off["error"]
    assert off["train"]["loss_curve"] == pytest.approx(base["train"]["loss_curve"], rel=1e-4)
    assert off["memory"]["peak_bytes"] < 0.8 * base["memory"]["peak_bytes"]


@pytest.mark.skipif(not _has("flash_attn"), reason="flash-attn not installed")
def test_flash_attention_2_matches_sdpa_packed(job):
    common = CUDA + ["precision=bf16_mixed", "packing=bfd"]
    sdpa = job(common + ["attention=sdpa"])
    fa2 = job(common + ["attention=flash_attention_2"])
    assert fa2["status"] == "ok", fa2["error"]
    assert fa2["train"]["loss_curve"] == pytest.approx(sdpa["train"]["loss_curve"], rel=2e-2)


@pytest.mark.skipif(not _has("liger_kernel"), reason="liger-kernel not installed")
def test_liger_same_loss_lower_peak(job):
    common = CUDA + ["model.vocab_size=65536"]
    base = job(common)
    lig = job(common + ["method.use_liger_kernel=true"])
    assert lig["status"] == "ok", lig["error"]
    assert lig["train"]["loss_curve"] == pytest.approx(base["train"]["loss_curve"], rel=1e-3)
    assert lig["memory"]["peak_bytes"] < base["memory"]["peak_bytes"]


@pytest.mark.skipif(not _has("liger_kernel"), reason="liger-kernel not installed")
@pytest.mark.parametrize("kernel", ["rms_norm", "swiglu"])
def test_liger_kernels_the_interpreter_cannot_run(tmp_path, kernel):
    """RMSNorm and SwiGLU fail inside Triton's interpreter (InterpreterError: AttributeError(
    "'float' object has no attribute 'to'"), triton 3.9 / liger-kernel 0.8.5), so only a GPU
    checks them: the plain path's loss and gradient norms (tests/cpu_kernels has RoPE and the
    fused loss on CPU). One fresh process, plain first: Liger's patch replaces transformers'
    module-level classes for the rest of a process."""
    from cpu_kernels.kernel_jobs import run_in_fresh_process

    runs = run_in_fresh_process(tmp_path, {"plain": CUDA, "liger": CUDA + [
        "method.use_liger_kernel=true", f"method.liger_kernels=[{kernel}]"]})
    base, lig = runs["plain"], runs["liger"]
    assert lig["status"] == "ok", lig["error"]
    assert lig["train"]["loss_curve"] == pytest.approx(base["train"]["loss_curve"], rel=1e-4)
    assert lig["train"]["curves"]["train/grad_norm"] == pytest.approx(
        base["train"]["curves"]["train/grad_norm"], rel=1e-3)


@pytest.mark.skipif(not _has("bitsandbytes"), reason="bitsandbytes not installed")
def test_qlora_needs_a_saved_model_and_trains(job, tmp_path):
    from memlab.data.assets import load_tokenizer
    from memlab.model.tiny import Tiny

    tok = load_tokenizer()
    cfg = Tiny(hidden_size=256, intermediate_size=512).hf_config(tok)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    s = job(CUDA + ["model=hf", f"model.name_or_path={tmp_path / 'm'}",
                    "model.local_files_only=true", "peft=qlora"])
    assert s["status"] == "ok", s["error"]


def test_fp16_mixed_trains(job):
    s = job(CUDA + ["precision=fp16_mixed"])
    assert s["status"] == "ok", s["error"]


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared-prompt"])
def test_torch_varlen_kernel_equals_its_reference(shared):
    """memlab's per-document attention on CUDA in bf16 runs torch's varlen_attn once over the
    batch (``attention/_varlen.py``); its causal mask must be bottom-right aligned (a completion
    sees its whole shared prompt) and equal, to bf16 precision, the per-document sdpa reference
    that tests/unit/attention/test_varlen_kernel.py checks against the CPU loop."""
    from torch.nn.attention.varlen import varlen_attn

    from memlab.attention._varlen import uses_varlen_kernel, varlen_attention, varlen_reference
    from memlab.trainer.batch import Segments

    segs = (Segments([(4, 3, (5, 0, 4), 4), (6, 2, (4, 0, 6), 4)]) if shared
            else Segments([(5, 3, 8), (16,)]))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (4, 2, 2))
    assert uses_varlen_kernel(q, 0.0)
    fast = varlen_attention(q, k, v, segs, scaling=0.125, kernel=varlen_attn)
    ref = varlen_attention(q.float(), k.float(), v.float(), segs, scaling=0.125,
                           kernel=varlen_reference)
    torch.testing.assert_close(fast.float(), ref, rtol=2e-2, atol=2e-2)
