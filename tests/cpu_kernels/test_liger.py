"""Liger-Kernel in memlab's methods, run on CPU by Triton's interpreter: every method that has a
Liger path (sft, dpo, kto) with the kernels the interpreter runs (RoPE and the fused linear
loss) gives the plain path's loss and gradient norms step by step; SFT's fused loss lowers the
forward's measured activations (no [tokens, vocab] logits). RMSNorm and SwiGLU fail inside
the interpreter: tests/gpu/test_cuda_paths.py checks them on a GPU.

The plain and the Liger jobs run in one fresh process, plain first (kernel_jobs.py: Liger's
patch changes transformers' modules for the rest of a process). Tiny shapes: the interpreter
runs each Triton program in Python (a 64-token RoPE forward and backward take ~1 s).
"""

from __future__ import annotations

import pytest

from cpu_kernels.kernel_jobs import NEEDS_LIGER, run_in_fresh_process

pytestmark = [pytest.mark.cpu_kernels, NEEDS_LIGER]

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
        "model.num_kv_heads=1", "model.intermediate_size=64",
        "train.gradient_checkpointing=false", "train.steps=2", "data.n_examples=8"]
METHODS = {
    # 2 x 64 tokens, all of them labelled: the logits (128 x 4096 floats) outweigh the fused
    # loss's gradient of the head (4096 x 32), so the fused loss must lower the activations
    "sft": ["method.max_length=64", "method.loss_on=all"],
    "dpo": ["method=dpo", "method.max_length=32", "train.batch_size=1"],
    "kto": ["method=kto", "method.max_length=24"],
}
LIGER = ["method.use_liger_kernel=true", "method.triton_interpret=true",
         "method.liger_kernels=[rope,fused_linear_cross_entropy]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("liger")
    jobs = {m: TINY + o for m, o in METHODS.items()}
    jobs |= {f"{m}_liger": TINY + o + LIGER for m, o in METHODS.items()}
    return run_in_fresh_process(tmp, jobs)


@pytest.mark.parametrize("method", list(METHODS))
def test_liger_gives_the_plain_loss_and_gradients(runs, method):
    plain, liger = runs[method], runs[f"{method}_liger"]
    assert plain["status"] == liger["status"] == "ok", (plain["error"], liger["error"])
    assert not plain["liger_imported_before"]  # the reference ran without any Liger patch
    assert liger["config"]["method"]["liger_kernels"] == ["rope", "fused_linear_cross_entropy"]
    assert liger["train"]["steps"] == plain["train"]["steps"] == 2
    # step 1's loss follows from step 0's gradient, the grad norms are the gradients' size
    assert liger["train"]["loss_curve"] == pytest.approx(plain["train"]["loss_curve"], rel=1e-5)
    assert liger["train"]["curves"]["train/grad_norm"] == pytest.approx(
        plain["train"]["curves"]["train/grad_norm"], rel=1e-4)


def test_fused_loss_lowers_sft_forward_activations(runs):
    def forward_activations(s: dict) -> int:
        return s["memory"]["by_phase_category"]["forward"]["activations"]

    plain, liger = forward_activations(runs["sft"]), forward_activations(runs["sft_liger"])
    assert liger < 0.5 * plain, (liger, plain)
