"""End-to-end SFT runs in-process on tiny models: summary contents, learning, determinism,
and the foundation's on-vs-off invariances (checkpointing, LoRA, grad accumulation, resume).

Tolerances: CPU fp32 runs of the same arithmetic repeat bit-for-bit, so same-seed runs and
checkpointing (which recomputes the same ops) are compared exactly; runs whose batches differ
in shape (grad accumulation, padding) are compared to 1e-5 relative.
"""

from __future__ import annotations

import math

import pytest

from memlab.measure.memory import CATEGORIES

pytestmark = pytest.mark.integration


def test_default_smoke_run_summary_is_complete(job, monkeypatch):
    monkeypatch.setenv("MEMLAB_CPU_BF16", "0")  # checks no precision: as on any CPU
    s = job(["debug=smoke"], fast=False)
    assert s["status"] == "ok", s["error"]
    assert s["error"] is None
    assert set(s["choices"]) >= {"method", "packing", "attention", "precision", "offload", "peft",
                                 "distributed", "model", "data", "logger"}
    m = s["memory"]
    assert m["source"] == "tracker" and m["device"] == "cpu"
    assert m["peak_bytes"] > 0
    assert set(m["by_category"]) == set(CATEGORIES)
    assert sum(m["by_category"].values()) == m["peak_bytes"]
    assert m["by_category"]["parameters"] > 0 and m["by_category"]["activations"] > 0
    assert set(m["by_phase"]) == {"forward", "backward", "optimizer"}
    assert max(m["by_phase"].values()) == m["peak_bytes"]
    assert all(v > 0 for v in m["by_phase"].values())
    t = s["throughput"]
    assert t["tokens_per_s"] > 0 and t["step_time_s"] > 0
    d = s["data"]
    assert 0.0 <= d["padding_fraction"] < 1.0
    assert d["tokens_dropped"] > 0  # the smoke config truncates at 256 tokens
    assert s["train"]["steps"] == 4 and math.isfinite(s["train"]["final_loss"])
    for key in ("torch", "transformers", "memlab"):
        assert s["versions"][key]
    assert s["device"]["type"] == "cpu"


def test_loss_falls_on_small_repeated_set(job):
    s = job(["data.n_examples=4", "train.steps=25", "train.lr=3e-3", "train.batch_size=4",
             "train.scheduler=constant", "measure.memory=false"])
    curve = s["train"]["loss_curve"]
    assert s["status"] == "ok"
    assert curve[-1] < 0.6 * curve[0], curve


def test_same_seed_same_loss_curve(job):
    a = job(["train.steps=4"])
    b = job(["train.steps=4"])
    c = job(["train.steps=4", "train.seed=1"])
    assert a["train"]["loss_curve"] == b["train"]["loss_curve"]
    assert a["memory"]["peak_bytes"] == b["memory"]["peak_bytes"]
    assert c["train"]["loss_curve"] != a["train"]["loss_curve"]


# Decoder layers must dominate activations (not the [tokens, vocab] logits) for checkpointing
# to show: 4 layers of width 128.
LAYERS = ["model.num_layers=4", "model.hidden_size=128", "model.intermediate_size=384",
          "measure.memory_steps=all"]


def test_checkpointing_same_loss_less_activation_memory(job):
    on = job(LAYERS + ["train.gradient_checkpointing=true"])
    off = job(LAYERS + ["train.gradient_checkpointing=false"])
    assert on["train"]["loss_curve"] == pytest.approx(off["train"]["loss_curve"], rel=1e-6)
    a_on = on["memory"]["by_phase_category"]["forward"]["activations"]
    a_off = off["memory"]["by_phase_category"]["forward"]["activations"]
    assert a_on < 0.6 * a_off, (a_on, a_off)
    assert on["memory"]["peak_bytes"] < off["memory"]["peak_bytes"]


def test_selective_checkpointing_sits_between(job):
    common = LAYERS
    every1 = job(common + ["train.checkpoint_every=1"])
    every2 = job(common + ["train.checkpoint_every=2"])
    off = job(common + ["train.gradient_checkpointing=false"])
    act = [r["memory"]["by_phase_category"]["forward"]["activations"]
           for r in (every1, every2, off)]
    assert act[0] < act[1] < act[2], act


def test_lora_fewer_gradient_and_optimizer_bytes(job):
    full = job(["peft=none", "measure.memory_steps=all"])
    lora = job(["peft=lora", "peft.r=4", "measure.memory_steps=all"])
    assert lora["status"] == "ok", lora["error"]
    f = full["memory"]["by_phase_category"]["optimizer"]
    lo = lora["memory"]["by_phase_category"]["optimizer"]
    assert lo["gradients"] < 0.25 * f["gradients"], (lo, f)
    assert lo["optimizer"] < 0.25 * f["optimizer"], (lo, f)
    assert lora["memory"]["params"]["trainable"] < full["memory"]["params"]["trainable"] / 4


def test_tracked_steps_leak_nothing_with_lora_and_checkpointing(job):
    """MemTracker's module hooks used to keep two hidden-state leaves alive per tracked step in
    LoRA + checkpointing runs; the measured peak crept up with every tracked step. Every step
    has the same shape here (long documents truncated to max_length, packed), so a leak-free
    tracker measures the same peak after 2 and after 5 tracked steps, reached at step 1."""
    o = ["peft=lora", "packing=bfd", "data.median_tokens=3000", "measure.memory_steps=all"]
    two, five = job(o + ["train.steps=2"]), job(o + ["train.steps=5"])
    assert five["status"] == "ok", five["error"]
    assert five["data"]["padding_fraction"] == 0.0
    assert five["memory"]["peak_bytes"] == two["memory"]["peak_bytes"]
    assert five["memory"]["peak_at"]["step"] == 1
    assert five["memory"]["tracked_steps"] == [0, 1, 2, 3, 4]


def test_grad_accumulation_1x4_equals_4x1(job):
    big = job(["train.batch_size=4", "train.grad_accum=1", "train.steps=3"])
    small = job(["train.batch_size=1", "train.grad_accum=4", "train.steps=3"])
    assert big["train"]["loss_curve"] == pytest.approx(small["train"]["loss_curve"], rel=1e-5)


def test_resume_gives_the_same_run(job, tmp_path):
    straight = job(["train.steps=4", "train.save_every=2"])
    ckpt = f"{straight['run_dir']}/checkpoints/step_000002"
    resumed = job(["train.steps=4", f"train.resume_from={ckpt}"])
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["train"]["loss_curve"] == pytest.approx(straight["train"]["loss_curve"],
                                                           rel=1e-6)


def test_bf16_halves_parameter_bytes(job):
    fp32 = job(["precision=fp32", "peft=none"])
    bf16 = job(["precision=bf16", "peft=none"])
    assert bf16["status"] == "ok", bf16["error"]
    assert bf16["memory"]["by_category"]["parameters"] * 2 == fp32["memory"]["by_category"][
        "parameters"]


def test_malformed_row_names_row_and_field(job, tmp_path):
    import json

    path = tmp_path / "bad.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]}] * 3
    rows.append({"messages": [{"role": "user", "content": None}]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    s = job(["data=local", f"data.path={path}"])
    assert s["status"] == "invalid"  # bad input, found before training
    assert "row 3" in s["error"] and "messages" in s["error"] and "content" in s["error"]


def test_activation_offload_same_loss_and_no_leak(job):
    """On CPU offloading saves nothing (validation says so); with allow_cpu the hooks run and
    must not change the loss, and they must not leak host copies."""
    rejected = job(["offload=activations"])
    assert rejected["status"] == "invalid" and "nothing to save" in rejected["error"]
    base = job(["train.steps=3", "measure.memory_steps=all"])
    for gc in ("true", "false"):
        off = job(["offload=activations", "offload.allow_cpu=true", "offload.min_bytes=1024",
                   "train.steps=3", f"train.gradient_checkpointing={gc}",
                   "measure.memory_steps=all"])
        assert off["status"] == "ok", off["error"]
        assert off["train"]["loss_curve"] == base["train"]["loss_curve"]
        stats = off["memory"]["offload"]
        assert stats["offloaded_bytes"] > 0
        assert stats["host_bytes"] == 0  # every host copy released after backward


def test_chunked_loss_same_loss_lower_peak_at_large_vocab(job):
    big_vocab = ["model.vocab_size=32768", "measure.memory_steps=all", "train.batch_size=4",
                 "method.max_length=256"]
    std = job(big_vocab + ["method.loss_impl=standard"])
    chk = job(big_vocab + ["method.loss_impl=chunked", "method.chunk_size=128"])
    assert chk["status"] == "ok", chk["error"]
    assert chk["train"]["loss_curve"] == pytest.approx(std["train"]["loss_curve"], rel=1e-5)
    assert chk["memory"]["peak_bytes"] < 0.75 * std["memory"]["peak_bytes"], (
        chk["memory"]["peak_bytes"], std["memory"]["peak_bytes"])


def test_liger_rejected_on_cpu_with_the_fix(job):
    s = job(["method.use_liger_kernel=true"])
    assert s["status"] == "invalid"
    assert "CUDA" in s["error"] and "memlab[gpu]" in s["error"]
