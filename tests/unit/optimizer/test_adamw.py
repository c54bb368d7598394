"""optimizer=adamw (torch's AdamW) and what every option shares: its knobs reach the optimizer;
``in_backward`` gives the parameters of the standard step (a tied head, checkpointed blocks)
and, in a run, the same loss curve and weights with the gradients freed at the peak; every
inexact combination is refused before anything loads, all at once; the old ``train.optimizer``
/ ``train.betas`` are refused with the new spelling; the state resumes through memlab's
checkpoint files."""

from __future__ import annotations

import pytest
import torch

from memlab.config import TrainConfig, moved_overrides
from memlab.registry import from_mapping
from unit.optimizer.steps import (
    FIXED,
    ctx_of,
    max_param_diff,
    problems,
    resumed_equals_uninterrupted,
    train_both_ways,
)


def test_knobs_reach_torch_adamw():
    ctx = ctx_of("optimizer.betas=[0.8,0.95]", "optimizer.eps=1e-6", "train.lr=0.01",
                 "train.weight_decay=0.1")
    p = torch.nn.Parameter(torch.zeros(2))
    opt = ctx.optimizer.build([p], ctx)
    assert isinstance(opt, torch.optim.AdamW)
    g = opt.param_groups[0]
    assert (g["betas"], g["eps"], g["lr"], g["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.01, 0.1)
    assert ctx.optimizer.group_settings() == {"betas": (0.8, 0.95), "eps": 1e-6}


def test_in_backward_steps_each_parameter_as_the_standard_step_does():
    """Five steps with weight decay: the in-backward model equals the standard one to 1e-5
    (the tied weight's two gradients are summed before its one step; a checkpointed block
    recomputes its forward with its own, not yet stepped, weights)."""
    std, inb, l_std, l_inb = train_both_ways(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    assert max_param_diff(std, inb) <= 1e-5
    assert l_std == pytest.approx(l_inb, abs=1e-5)
    assert l_std[-1] < l_std[0]  # it trained


@pytest.mark.pipeline
def test_in_backward_run_frees_the_gradients_and_trains_the_same(job):
    """A run: the same loss curve and saved weights as the standard step (no clipping); the
    gradients at the peak drop from all of them to those backward is still producing."""
    from memlab.trainer.checkpoint import read_weights

    # short rows: the model states dominate, and the standard step peaks with every gradient
    # (torch's AdamW loop, optimizer.fused=false: its temporary puts the peak in the step; the
    # default fused step peaks in the backward, before the last gradients exist)
    common = [*FIXED, "train.steps=3", "train.save_final=true", "measure.memory_steps=all",
              "method.max_length=32", "model.hidden_size=128", "model.intermediate_size=384",
              "optimizer.fused=false"]
    std, inb = job(common), job([*common, "optimizer.in_backward=true"])
    assert std["status"] == inb["status"] == "ok", (std["error"], inb["error"])
    assert inb["train"]["loss_curve"] == pytest.approx(std["train"]["loss_curve"], abs=1e-5)
    w_std = read_weights(std["train"]["checkpoint"])
    w_inb = read_weights(inb["train"]["checkpoint"])
    assert max(float((w_std[k] - w_inb[k]).abs().max()) for k in w_std) <= 1e-5
    g_std = std["memory"]["by_category"]["gradients"]
    g_inb = inb["memory"]["by_category"]["gradients"]
    head = 4096 * 128 * 4  # the largest gradient: the output head's (untied), fp32
    assert std["memory"]["peak_at"]["phase"] == "optimizer"  # with the step's gradients
    assert g_inb <= head < g_std, (g_inb, g_std)
    assert inb["memory"]["peak_bytes"] < std["memory"]["peak_bytes"]
    assert "train/grad_norm" not in inb["train"].get("curves", {})


def test_in_backward_refuses_every_inexact_combination_at_once():
    text = problems("optimizer.in_backward=true", "train.grad_accum=2")
    assert "train.grad_accum=2" in text and "train.grad_accum=1" in text
    assert "train.max_grad_norm=1.0" in text and "train.max_grad_norm=null" in text
    ddp = problems("optimizer.in_backward=true", *FIXED, "distributed=ddp")
    assert "distributed=ddp" in ddp and "distributed=fsdp2" in ddp
    assert "owns the optimizer step" in problems("optimizer.in_backward=true", *FIXED,
                                                 "distributed=deepspeed")
    assert problems("optimizer.in_backward=true", *FIXED) == ""
    assert problems("optimizer.in_backward=true", *FIXED, "distributed=fsdp2") == ""


def test_fp16_loss_scaling_is_refused_in_backward():
    from memlab.config import Platform

    text = problems("optimizer.in_backward=true", *FIXED, "precision=fp16_mixed",
                    "train.device=cuda", platform=Platform.cuda_machine(gpus=1))
    assert "precision=fp16_mixed" in text and "precision=bf16_mixed" in text


def test_the_old_train_keys_are_refused_with_the_new_spelling():
    _, errors = from_mapping(TrainConfig, {"optimizer": "sgd", "betas": [0.9, 0.9]}, "train")
    assert any("train.optimizer has moved" in e and "optimizer=sgd" in e for e in errors)
    assert any("train.betas has moved" in e and "optimizer.betas=" in e for e in errors)
    cli = moved_overrides(["train.optimizer=sgd", "+train.betas=[0.9,0.9]", "train.lr=1"])
    assert len(cli) == 2 and "optimizer=sgd" in cli[0] and "optimizer.betas" in cli[1]


def test_state_resumes_through_the_checkpoint_files(tmp_path):
    assert resumed_equals_uninterrupted(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), tmp_path) == 0.0


def test_fused_steps_without_temporaries_to_the_same_parameters():
    """optimizer.fused=true: torch's fused kernel, the same parameters as the default
    implementation (float rounding) with no parameter-sized temporaries in the step
    (measured: the optimizer phase holds the states and the gradient only)."""
    from torch import nn

    from memlab.measure.memory import MemoryProbe

    peaks, weights = {}, {}
    for fused in (False, True):
        ctx = ctx_of(f"optimizer.fused={str(fused).lower()}", "train.lr=0.01",
                     "train.weight_decay=0.1")
        torch.manual_seed(0)
        layer = nn.Linear(256, 256, bias=False)
        opt = ctx.optimizer.build(list(layer.parameters()), ctx)
        assert opt.defaults["fused"] is (True if fused else None)
        probe = MemoryProbe("cpu")
        probe.watch(layer, opt)
        for step in range(2):
            with probe.step(step, True):
                with probe.phase("forward"):
                    loss = layer(torch.ones(2, 256)).pow(2).sum()
                with probe.phase("backward"):
                    loss.backward()
                with probe.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        peaks[fused] = probe.result()["by_phase"]["optimizer"]
        weights[fused] = layer.weight.detach().clone()
    size = 256 * 256 * 4
    assert peaks[True] <= 4 * size + 4096  # weight, gradient, two moments (+ step scalars)
    assert peaks[False] >= peaks[True] + 2 * size  # torch's loop: sqrt, then the division
    torch.testing.assert_close(weights[True], weights[False], rtol=0, atol=1e-6)


@pytest.mark.pipeline
def test_in_backward_keeps_one_gradient_of_a_tied_weight(job):
    """A head tied to the input embedding (SFT's chunked loss): the loss hands its gradient of
    the weight to the embedding lookup's backward, which adds its rows in place, so that the
    in-backward peak holds one weight-sized gradient of it, not the head's, the embedding's and
    their sum (autograd's input buffer sums out of place under any dispatch mode, the memory
    tracker's included). torch's default AdamW then steps it with one parameter-sized
    temporary, not two (its multi-tensor implementation on the one parameter: the same
    floats). The same loss curve and weights as the standard step. CPU bytes: exact."""
    from memlab.trainer.checkpoint import read_weights

    vocab, hidden = 16384, 64
    tied = vocab * hidden * 4  # fp32: 4 MiB, most of the model
    common = [*FIXED, "model.tie_word_embeddings=true", f"model.vocab_size={vocab}",
              f"model.hidden_size={hidden}", "train.steps=2", "method.max_length=32",
              "measure.memory_steps=all", "train.save_final=true"]
    std = job(common)
    fused = job([*common, "optimizer.in_backward=true", "optimizer.fused=true"])
    loop = job([*common, "optimizer.in_backward=true"])  # torch's default implementation
    for s in (std, fused, loop):
        assert s["status"] == "ok", s["error"]
    w_std = read_weights(std["train"]["checkpoint"])
    for s in (fused, loop):
        assert s["train"]["loss_curve"] == pytest.approx(std["train"]["loss_curve"], abs=1e-5)
        w = read_weights(s["train"]["checkpoint"])
        assert max(float((w_std[k] - w[k]).abs().max()) for k in w_std) <= 1e-5
    params = std["memory"]["by_category"]["parameters"]
    states = 2 * params  # AdamW's two moments, all of them from step 0's last hook on
    # fused: the backward peak holds the head's gradient of the tied weight and the
    # activations left (was: three weight-sized tensors)
    back = fused["memory"]["by_phase_category"]["backward"]
    assert back["gradients"] + back["activations"] < 1.5 * tied, back
    # the default loop: the summed gradient and one temporary at its step (was: two)
    back = loop["memory"]["by_phase_category"]["backward"]
    assert back["gradients"] + back["activations"] + back["optimizer"] - states < 2.5 * tied, \
        back


@pytest.mark.pipeline
def test_the_standard_cpu_step_makes_one_temporary_with_the_same_floats(job):
    """torch's default AdamW on CPU tensors (the single-tensor loop) makes two temporaries of
    each parameter's size; memlab steps each parameter alone with the multi-tensor code: one
    temporary, bit for bit the same parameters."""
    import copy

    from torch import nn

    from memlab.trainer import optim

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    b = copy.deepcopy(a)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        x = torch.randn(8, 64)
        for m in (a, b):
            m(x).square().sum().backward()
        oa.step()
        optim.step(ob)
        oa.zero_grad()
        ob.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert ob.param_groups[0]["foreach"] is None  # the state dict is the standard step's

    common = [*FIXED, "train.steps=2", "measure.memory_steps=all", "method.max_length=32",
              "model.hidden_size=128", "model.intermediate_size=384",
              "optimizer.fused=false"]  # (the default fused kernel makes none)
    s = job(common)
    params = s["memory"]["by_category"]["parameters"]
    in_step = s["memory"]["by_phase_category"]["optimizer"]["optimizer"]
    head = 4096 * 128 * 4  # the largest parameter: the output head (untied), fp32
    assert head <= in_step - 2 * params < 2 * head  # two moments + one temporary
