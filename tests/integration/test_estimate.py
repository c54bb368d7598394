"""`memlab estimate` against real measurements: on tiny models the fake-tensor estimate's peak
and categories agree with the CPU tracker of a real run of the same batch shape (within 3%),
estimates move the right way when a technique is switched on, verdicts, sweeps, the CLI, and a
1B-parameter estimate with under 1 GiB of real memory (slow; its time is in benchmarks/estimate.py).

Real runs use long documents (median 3,000 tokens) truncated at max_length, so every row has
exactly max_length tokens: padded batches are [batch_size, max_length] without padding, packed
padding-free batches one flat row of batch_size * max_length tokens - the shapes the estimate
assumes. They run two steps, both tracked (``measure.memory_steps=all``), like the estimate's
steady-state step 1 after step 0's optimizer update.

Every case agrees to the byte on this CPU build (the printed table shows it); the 3% bound is
the issue's. LoRA + checkpointing used to differ by ~1.5% per tracked step because MemTracker
leaked two hidden-state leaves per tracked step (fixed in ``memlab.measure.memory``; its
regression test is in test_train.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from memlab.cli.estimate import main as estimate_main
from memlab.measure.memory import CATEGORIES
from memlab_testing import REPO

pytestmark = pytest.mark.integration

SHAPE = ["model.hidden_size=128", "model.intermediate_size=384", "model.num_layers=2",
         "train.batch_size=2", "data.n_examples=32", "data.median_tokens=3000",
         "train.device=cpu", "train.progress=false"]
LEN = ["method.max_length=256"]
REAL = ["measure.memory_steps=all", "train.steps=2"]


def _estimate(tmp_path, overrides, *extra):
    out = tmp_path / ("est_" + str(abs(hash(tuple(overrides + list(extra))))))
    code = estimate_main([*overrides, *extra, "--out", str(out)])
    assert code == 0
    est = json.loads((out / "estimate.json").read_text())
    assert est["status"] == "ok", est["error"]
    return est


CASES = {
    "full packed": ["packing=bfd", *LEN],
    "lora packed": ["packing=bfd", "peft=lora", *LEN],
    "no checkpointing": ["packing=bfd", "train.gradient_checkpointing=false", *LEN],
    "bf16": ["packing=bfd", "precision=bf16", *LEN],
    "chunked loss": ["packing=bfd", "method.loss_impl=chunked", "method.chunk_size=128", *LEN],
    "padded bf16_mixed eager": ["packing=none", "precision=bf16_mixed", "attention=eager", *LEN],
    "dpo reference copy": ["packing=none", "method=dpo", *LEN],
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_matches_real_run_within_3_percent(job, tmp_path, case):
    overrides = SHAPE + CASES[case]
    est = _estimate(tmp_path, overrides)
    real = job(overrides + REAL, fast=False)
    assert real["status"] == "ok", real["error"]
    assert real["data"]["padding_fraction"] == 0.0  # every real batch has the estimated shape
    rm = real["memory"]
    rp, ep = rm["peak_bytes"], est["peak_bytes"]
    rows = [f"{'peak':12}{ep:>12}{rp:>12}{100 * (ep - rp) / rp:+8.2f}%"]
    for cat in CATEGORIES:
        e, r = est["by_category"][cat], rm["by_category"][cat]
        rows.append(f"{cat:12}{e:>12}{r:>12}" + (f"{100 * (e - r) / r:+8.2f}%" if r else ""))
    print(f"\n[{case}] estimate vs real (bytes)\n" + "\n".join(rows))
    assert abs(ep - rp) <= 0.03 * rp, (ep, rp)
    for cat in CATEGORIES:
        e, r = est["by_category"][cat], rm["by_category"][cat]
        assert abs(e - r) <= 0.03 * r + 64 * 1024, (cat, e, r)
    assert est["peak_at"]["phase"] == rm["peak_at"]["phase"]


# Online methods: prompts cut to 64 tokens (the long conversations' prompts all are), 16 new
# tokens; the tiny random model never samples EOS within 16 tokens at these seeds (asserted), so
# the real completions have the full length the estimate assumes.
ONLINE = ["method.max_prompt_length=64", "method.max_completion_length=16"]
ONLINE_CASES = {
    "grpo": ["method=grpo", *ONLINE],
    "grpo lora kl adapter_disabled": ["method=grpo", *ONLINE, "peft=lora", "method.beta=0.04",
                                      "method.reference=adapter_disabled"],
    "rloo reference copy": ["method=rloo", *ONLINE],
    "online_dpo": ["method=online_dpo", *ONLINE],
    "grpo reward model": ["method=grpo", *ONLINE, "method.rewards=[]",
                          "method.reward_models=[{hidden_size: 256, num_layers: 2, seed: 3}]"],
    "ppo value model": ["method=ppo", *ONLINE],
    "gkd on-policy": ["method=gkd", "method.lmbda=1.0", "method.max_prompt_length=64",
                      "method.max_new_tokens=16"],
}


@pytest.mark.parametrize("case", list(ONLINE_CASES))
def test_online_estimate_matches_real_run_within_3_percent(job, tmp_path, case):
    """The generate phase (the model's own generate on fake tensors, to the full length) and the
    training step on the generated batch, against a real run's tracker, phase by phase."""
    overrides = SHAPE + ONLINE_CASES[case]
    est = _estimate(tmp_path, overrides)
    real = job(overrides + REAL, fast=False)
    assert real["status"] == "ok", real["error"]
    curves = real["train"].get("curves") or {}
    if "completions/mean_length" in curves:  # every completion ran to the full 16 tokens
        assert curves["completions/mean_length"] == [16.0, 16.0]
    rm = real["memory"]
    rp, ep = rm["peak_bytes"], est["peak_bytes"]
    rows = [f"{'peak':12}{ep:>12}{rp:>12}{100 * (ep - rp) / rp:+8.2f}%"]
    for ph in ("generate", "forward", "backward", "optimizer"):
        e, r = est["by_phase"][ph], rm["by_phase"][ph]
        rows.append(f"{ph:12}{e:>12}{r:>12}{100 * (e - r) / r:+8.2f}%")
    print(f"\n[{case}] estimate vs real (bytes)\n" + "\n".join(rows))
    assert est["batch"]["shapes"]["input_ids"][1] == 64 + 16
    assert abs(ep - rp) <= 0.03 * rp, (ep, rp)
    for ph in ("generate", "forward", "backward", "optimizer"):
        assert abs(est["by_phase"][ph] - rm["by_phase"][ph]) <= 0.03 * rm["by_phase"][ph], ph
    for cat in CATEGORIES:
        e, r = est["by_category"][cat], rm["by_category"][cat]
        assert abs(e - r) <= 0.03 * r + 64 * 1024, (cat, e, r)
    assert est["peak_at"]["phase"] == rm["peak_at"]["phase"]


def test_online_estimates_move_the_right_way(tmp_path):
    base_o = SHAPE + ["method=grpo", *ONLINE]
    base = _estimate(tmp_path, base_o)
    longer = _estimate(tmp_path, base_o[:-1] + ["method.max_completion_length=48"])
    more = _estimate(tmp_path, base_o + ["method.num_generations=8"])
    kl = _estimate(tmp_path, base_o + ["method.beta=0.04"])
    assert longer["batch"]["shapes"]["input_ids"] == [8, 64 + 48]
    assert more["batch"]["shapes"]["input_ids"] == [16, 64 + 16]
    # more rows: a larger prefill and KV cache in generate; longer or more rows: a larger
    # training batch (the generate phase of this tiny model peaks in its prefill)
    assert more["by_phase"]["generate"] > base["by_phase"]["generate"]
    for bigger in (longer, more):
        assert bigger["by_category"]["activations"] > base["by_category"]["activations"]
        assert bigger["peak_bytes"] > base["peak_bytes"]
    # beta > 0 loads a frozen reference copy: one more model's parameters, no more optimizer
    assert kl["by_category"]["parameters"] == 2 * base["by_category"]["parameters"]
    assert kl["by_category"]["optimizer"] == base["by_category"]["optimizer"]
    assert "reference" in kl["model"]["extra_models"]
    assert any("generation: every completion runs to 16" in a for a in base["assumptions"])


def test_estimates_move_the_right_way(tmp_path):
    base_o = SHAPE + ["packing=bfd", *LEN]
    base = _estimate(tmp_path, base_o)
    no_gc = _estimate(tmp_path, base_o + ["train.gradient_checkpointing=false"])
    lora = _estimate(tmp_path, base_o + ["peft=lora"])
    bf16 = _estimate(tmp_path, base_o + ["precision=bf16"])
    z3 = _estimate(tmp_path, base_o, "--world-size", "8", "--zero-stage", "3")
    cats = {n: e["by_category"] for n, e in
            (("base", base), ("no_gc", no_gc), ("lora", lora), ("bf16", bf16), ("z3", z3))}
    assert cats["no_gc"]["activations"] > cats["base"]["activations"]
    assert (cats["lora"]["optimizer"] + cats["lora"]["gradients"]
            < (cats["base"]["optimizer"] + cats["base"]["gradients"]) / 4)
    assert lora["by_phase_category"]["optimizer"]["gradients"] < \
        base["by_phase_category"]["optimizer"]["gradients"] / 4
    assert cats["bf16"]["parameters"] * 2 == pytest.approx(cats["base"]["parameters"], rel=0.01)
    # ZeRO-3 / FSDP over 8 ranks: parameters and optimizer state split 8 ways per rank (plus
    # two gathered units in forward/backward); the unsharded numbers are kept for reference
    z3_opt = z3["by_phase_category"]["optimizer"]
    base_opt = base["by_phase_category"]["optimizer"]
    assert z3_opt["parameters"] == pytest.approx(base_opt["parameters"] / 8, rel=0.01)
    assert z3_opt["optimizer"] == pytest.approx(base_opt["optimizer"] / 8, rel=0.01)
    assert z3["unsharded"]["by_category"] == base["by_category"]
    assert z3["peak_bytes"] < base["peak_bytes"]
    assert any("zero_stage=3" in a for a in z3["assumptions"])


def test_cuda_model_offload_and_qlora(tmp_path):
    base_o = SHAPE + ["packing=none", "train.gradient_checkpointing=false", *LEN]
    cpu = _estimate(tmp_path, base_o)
    cuda = _estimate(tmp_path, base_o, "--device", "cuda")
    # 512-byte blocks + cuBLAS workspace: never below the byte-exact CPU number
    assert cuda["peak_bytes"] > cpu["peak_bytes"]
    assert cuda["by_category"]["other"] >= 8 * 1024**2
    off = _estimate(tmp_path, base_o + ["offload=activations", "offload.min_bytes=0"],
                    "--device", "cuda")
    assert off["by_category"]["activations"] < cuda["by_category"]["activations"]
    assert off["offload"]["host_peak_bytes"] > 0
    # qlora validates as a CUDA run (no bitsandbytes here) and stores the base in 4 bits
    q = _estimate(tmp_path, base_o + ["peft=qlora", "precision=bf16"], "--card", "a10g")
    assert q["model"]["quantized_linears"] == 2 * 7  # q k v o gate up down per layer
    assert "uint8(4-bit)" in q["model"]["bytes_by_dtype"]
    assert q["verdict"]["fits"] and q["card"]["key"] == "a10g"


def test_exact_masks_remove_the_fake_tensor_mask(tmp_path):
    """Transformers treats fake inputs as tracing and materialises a mask an unpadded real
    batch never builds; the estimator decides from the real batch values instead."""
    o = SHAPE + ["packing=none", "attention=sdpa", *LEN]
    exact = _estimate(tmp_path, o)
    inexact = _estimate(tmp_path, o, "--inexact-masks")
    assert inexact["peak_bytes"] > exact["peak_bytes"]


def test_verdict_against_a_budget(tmp_path):
    o = SHAPE + ["packing=bfd", *LEN]
    small = _estimate(tmp_path, o, "--budget", "1MiB")
    big = _estimate(tmp_path, o, "--budget", "24GiB")
    assert not small["verdict"]["fits"] and "does not fit: over by" in small["verdict"]["text"]
    assert small["verdict"]["dominant"] in CATEGORIES
    assert big["verdict"]["fits"] and big["verdict"]["text"].startswith("fits with")


def test_sweep_of_estimates(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = estimate_main([*SHAPE, *LEN, "-m", "peft=none,lora", "packing=none,bfd",
                          "--budget", "38MiB", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    lines = [line for line in table.splitlines() if line.startswith(("none", "lora"))]
    assert len(lines) == 4 and "peft" in table and "packing" in table
    assert any("does not fit" in line for line in lines)  # full fine-tuning: ~44 MiB
    assert any("fits with" in line for line in lines)  # LoRA: under
    sweep = json.loads((out / "sweep.json").read_text())
    assert [p["sweep_point"] for p in sweep["points"]][0] == ["peft=none", "packing=none"]
    assert all((out / str(i) / "estimate.json").exists() for i in range(4))


def test_invalid_config_and_module_entry_point(tmp_path):
    code = estimate_main([*SHAPE, "attention=flash_attention_2", "precision=bf16",
                          "--out", str(tmp_path)])
    assert code == 2
    est = json.loads((tmp_path / "estimate.json").read_text())
    assert est["status"] == "invalid" and "--device cuda" in est["error"]
    r = subprocess.run([sys.executable, "-m", "memlab.cli.estimate", "--cards"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "h100-80gb" in r.stdout


def test_python_m_memlab_mode_estimate(tmp_path):
    """The issue's spelling: ``python -m memlab mode=estimate <run overrides> [--options]``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "memlab", "mode=estimate", *SHAPE, *LEN,
                        "packing=bfd", "--budget", "1GiB", "--out", str(tmp_path)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    est = json.loads((tmp_path / "estimate.json").read_text())
    assert est["status"] == "ok" and est["verdict"]["fits"]
    assert "estimated peak:" in r.stdout and "packing=bfd" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "memlab", "mode=estimat"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "mode=estimate" in bad.stderr


LLAMA_1B = ["model.hidden_size=2048", "model.num_layers=16", "model.num_heads=32",
            "model.num_kv_heads=8", "model.intermediate_size=8192", "model.vocab_size=32000",
            "method.max_length=2048", "train.batch_size=4", "packing=none"]


@pytest.mark.slow
def test_1b_model_estimates_with_under_1gib_of_real_memory(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "memlab.cli.estimate", *LLAMA_1B,
                        "--out", str(tmp_path), "--budget", "24GiB"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    est = json.loads((tmp_path / "estimate.json").read_text())
    print(f"\n1B estimate: process {wall:.1f} s, estimate() {est['estimator']['wall_s']:.1f} s, "
          f"max RSS {est['estimator']['max_rss_bytes'] / 2**20:.0f} MiB, peak "
          f"{est['peak_bytes'] / 2**30:.2f} GiB")
    assert est["model"]["total"] == pytest.approx(1.1e9, rel=0.05)
    assert est["by_category"]["parameters"] == 4 * est["model"]["total"]  # fp32
    assert est["by_phase_category"]["optimizer"]["optimizer"] >= 8 * est["model"]["total"]
    assert est["batch"]["shapes"]["input_ids"] == [4, 2048]
    # the "under a minute" is a wall-clock target: benchmarks/estimate.py measures it
    # (tests never assert times); real memory is repeatable, so it is asserted here
    assert est["estimator"]["max_rss_bytes"] < 2**30
