"""`distributed=deepspeed` on CPU with real DeepSpeed (its CPU accelerator, gloo, 2 worker
processes started by memlab's launcher): every ZeRO stage trains exactly like one process with
the whole batch, each stage shards what it should (measured by each rank's tracker), generation
under ZeRO-3 gives the same samples with or without gathering the weights once, and checkpoints
resume to the same run."""

from __future__ import annotations

import pytest
import torch

from memlab._guards import has
from memlab.trainer.checkpoint import read_weights
from memlab_testing import LORA_CHUNKED

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not has("deepspeed"), reason="needs the deepspeed extra")]


@pytest.fixture(autouse=True)
def stale_extension_lock(tmp_path_factory, monkeypatch):
    """Every DeepSpeed run here starts beside a lock file left by a stopped JIT build of
    DeepSpeed's CPU shared-memory kernel (torch waits on such a lock forever): memlab must not
    build that kernel, so the runs finish anyway."""
    ext = tmp_path_factory.mktemp("torch_extensions")
    (ext / "deepspeed_shm_comm").mkdir()
    (ext / "deepspeed_shm_comm" / "lock").write_text("")  # <TORCH_EXTENSIONS_DIR>/<name>/lock
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))


def DS(stage: int) -> list[str]:
    return ["distributed=deepspeed", "distributed.nproc=2", f"distributed.zero_stage={stage}"]


def _ok(*summaries):
    for s in summaries:
        assert s["status"] == "ok", s["error"]


def _weights(summary) -> dict[str, torch.Tensor]:
    step = summary["train"]["steps"]
    return read_weights(f"{summary['run_dir']}/checkpoints/step_{step:06d}")


SHAPE = ["method.max_length=256", "data.median_tokens=3000", "packing=bfd", "method.loss_on=all"]
"""Long documents cut at max_length, loss on every token: every row is one document of 256
tokens, the same rows however the ranks split the batch, and the estimate's worst-case rows
(SFT's head runs at the labelled positions only, so completion-only rows would need less);
both micro-batches the same size, so the second one's forward is the larger. The model is
:data:`memlab_testing.FAST`'s (fp32, hidden 64, 2 layers): at hidden 128 the weight that
straddles the two ranks' partitions is a larger share of all, and stage 2's gradients are
2.3% over half (the 2% :func:`test_each_stage_shards_what_it_should` allows)."""

STAGE_RUN = SHAPE + ["train.steps=3", "train.save_final=true", "measure.memory_steps=2"]
"""One run per ZeRO stage, shared by every test that reads one (training like one process,
each stage's shards, the estimate of each stage, resume): 2 ranks x 1 row x 2 micro-batches
per step (DeepSpeed's accumulation boundary), the first two steps tracked; stage 2 also saves
at step 2 (the checkpoint :func:`test_resume_from_a_deepspeed_checkpoint` resumes)."""


def stage_overrides(key) -> list[str]:
    """The single-process run (key "single", 4 rows a step) or ZeRO stage ``key``'s."""
    if key == "single":
        return STAGE_RUN + ["train.batch_size=4"]
    return (STAGE_RUN + DS(key) + ["train.batch_size=1", "train.grad_accum=2"]
            + (["train.save_every=2"] if key == 2 else []))


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    """``runs(key)``: the summary of :func:`stage_overrides` ``(key)``'s run, once per module."""
    from memlab_testing import run_job

    root, done = tmp_path_factory.mktemp("zero_stages"), {}

    def runs(key):
        if key not in done:
            done[key] = run_job(root, stage_overrides(key), name=f"stage_{key}")
        return done[key]

    return runs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_like_one_process(stage_runs, stage):
    """2 ranks x 1 row x 2 micro-batches (DeepSpeed's accumulation boundary) == 1 process x 4
    rows: the same loss curve, tokens and final weights (gathered from the shards)."""
    single, ds = stage_runs("single"), stage_runs(stage)
    _ok(single, ds)
    assert len(ds["train"]["loss_curve"]) == 3
    assert ds["train"]["loss_curve"] == pytest.approx(single["train"]["loss_curve"], rel=2e-5)
    assert ds["data"]["tokens_trained"] == single["data"]["tokens_trained"]
    w1, w2 = _weights(single), _weights(ds)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)
    assert ds["memory"]["distributed"]["zero_stage"] == stage


def test_each_stage_shards_what_it_should(stage_runs):
    """Per rank, 2 ranks, 2 micro-batches per step, measured in the second micro-batch's
    forward (state of the previous step and gradients of the first micro-batch alive):
    stage 0 holds full gradients and Adam's two moments; stage 1 half of the moments plus a
    half-size fp32 master copy, still full gradients; stage 2 also half of the gradients;
    stage 3 also half of the parameters. (The runs are :func:`stage_runs`'.)"""
    runs = {s: stage_runs(s) for s in (0, 1, 2, 3)}
    _ok(*runs.values())
    fwd = {s: r["memory"]["by_phase_category"]["forward"] for s, r in runs.items()}
    step = {s: r["memory"]["by_phase_category"]["optimizer"] for s, r in runs.items()}
    P = step[0]["parameters"]  # fp32, every weight trainable: 4 bytes per weight
    assert P > 0
    expect = {  # (optimizer state, gradients) in units of P
        0: (2.0, 1.0), 1: (1.5, 1.0), 2: (1.5, 0.5), 3: (1.5, 0.5)}
    for s, (opt, grads) in expect.items():
        assert fwd[s]["optimizer"] == pytest.approx(opt * P, rel=0.02), s
        assert fwd[s]["gradients"] == pytest.approx(grads * P, rel=0.02), s
    for s in (0, 1, 2):
        assert step[s]["parameters"] == P
    assert step[3]["parameters"] == pytest.approx(P / 2, rel=0.02)
    peaks = {s: r["memory"]["peak_bytes_max_rank"] for s, r in runs.items()}
    assert peaks[1] < peaks[0] and peaks[2] < peaks[1], peaks




def test_lora_chunked_loss_and_dpo_under_zero3(job):
    """Paths that read a weight outside its module's forward (the chunked loss reads the output
    head) or hold a second model (DPO's reference copy) under ZeRO-3."""
    from memlab_testing import shared_job

    single, _ = shared_job(LORA_CHUNKED + ["train.batch_size=4"])
    ds, _ = shared_job(LORA_CHUNKED + DS(3) + ["train.batch_size=2"])
    _ok(single, ds)
    assert ds["train"]["loss_curve"] == pytest.approx(single["train"]["loss_curve"], rel=1e-4)
    o = ["train.steps=2", "measure.memory_steps=0", "method=dpo", "method.max_length=96"]
    single = job(o + ["train.batch_size=4"])
    ds = job(o + DS(3) + ["train.batch_size=2"])
    _ok(single, ds)
    assert ds["train"]["loss_curve"] == pytest.approx(single["train"]["loss_curve"], rel=1e-4)


def test_bf16_keeps_fp32_master_weights_and_moments(job):
    """precision=bf16 under DeepSpeed is its bf16 mode: bf16 weights, and per rank an fp32
    master slice plus fp32 Adam moments of the slice (at 2 ranks and stage 1: (4 + 8) / 2 = 6
    bytes per weight = 3x the bf16 parameter bytes); it trains (the loss falls) and
    bf16_mixed (fp32 engine under autocast) runs too."""
    o = ["train.steps=4", "train.batch_size=2", "measure.memory_steps=2", "train.lr=3e-3"]
    bf16 = job(o + DS(1) + ["precision=bf16"])
    mixed = job(o + DS(1) + ["precision=bf16_mixed"])
    _ok(bf16, mixed)
    fwd = bf16["memory"]["by_phase_category"]["forward"]
    assert fwd["optimizer"] == pytest.approx(3 * fwd["parameters"], rel=0.02), fwd
    mixed_fwd = mixed["memory"]["by_phase_category"]["forward"]
    assert mixed_fwd["parameters"] == pytest.approx(2 * fwd["parameters"], rel=0.01)
    for s in (bf16, mixed):
        curve = s["train"]["loss_curve"]
        assert curve[-1] < curve[0], curve


def test_resume_from_a_deepspeed_checkpoint(job, stage_runs):
    """Stage 2's run (:func:`stage_runs`) saved at step 2 (each rank its shards, DeepSpeed's
    format); resumed from there to step 3: the same loss curve and final weights as the
    straight run; a replicated run refuses it."""
    straight = stage_runs(2)
    _ok(straight)
    ckpt = f"{straight['run_dir']}/checkpoints/step_000002"
    resumed = job(stage_overrides(2) + ["measure.memory_steps=0", f"train.resume_from={ckpt}"])
    _ok(resumed)
    assert resumed["resume"]["step"] == 2
    assert resumed["train"]["loss_curve"] == pytest.approx(straight["train"]["loss_curve"],
                                                           rel=1e-5)
    w1, w2 = _weights(straight), _weights(resumed)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-7)
    bad = job(["train.steps=4", f"train.resume_from={ckpt}"])  # refused before loading
    assert bad["status"] == "invalid" and "distributed=deepspeed" in bad["error"]


def test_invalid_deepspeed_setups_are_rejected_before_loading(job):
    bad = job(["distributed=deepspeed", "distributed.zero_stage=4",
               "distributed.offload_optimizer=cpu", "precision=fp16_mixed"])
    assert bad["status"] == "invalid"
    for needle in ("distributed (deepspeed).zero_stage: must be in [0, 3] (got 4)", "offload_optimizer=cpu",
                   "precision=fp16_mixed"):
        assert needle in bad["error"], bad["error"]
    ppo = job(["distributed=deepspeed", "method=ppo"])
    assert ppo["status"] == "invalid" and "method=ppo" in ppo["error"]


def _estimate(tmp_path, overrides: list[str]) -> dict:
    """``memlab estimate`` of the run ``overrides`` (on :data:`memlab_testing.FAST`) describe,
    in this process."""
    import json

    from memlab.cli.estimate import main as estimate_main
    from memlab_testing import with_fast

    out = tmp_path / "est"
    assert estimate_main([*with_fast(overrides), "--out", str(out)]) == 0
    return json.loads((out / "estimate.json").read_text())


def _agrees(est, real, ranks: int) -> None:
    """The estimate measured a rank (DeepSpeed's engine on fake tensors over a fake process
    group): its peak and its backward categories equal the real run's largest rank's within 1%
    (gloo may free a collective's input a moment late in the real run)."""
    assert est["status"] == "ok", est["error"]
    _ok(real)
    assert any(f"rank 0 of {ranks} measured" in a for a in est["assumptions"])
    ep, rp = est["peak_bytes"], real["memory"].get("peak_bytes_max_rank", real["memory"][
        "peak_bytes"])
    print(f"\n[{est['choices'].get('distributed')} {est['options']['zero_stage']}] estimate {ep} "
          f"real {rp} {100 * (ep - rp) / rp:+.2f}%")
    assert abs(ep - rp) <= 0.01 * rp, (ep, rp)
    for cat, v in real["memory"]["by_phase_category"]["backward"].items():
        assert est["by_phase_category"]["backward"][cat] == pytest.approx(v, rel=0.01,
                                                                          abs=64 * 1024), cat


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_of_each_stage_matches_the_busiest_rank(stage_runs, tmp_path, stage):
    """``memlab estimate distributed=deepspeed`` runs DeepSpeed's engine (master copy, buckets,
    partitions, gathered layers: all its own) on fake tensors as rank 0 of a fake process group,
    and agrees with the real 2-rank run of the stage (:func:`stage_runs`, :func:`_agrees`)."""
    est = _estimate(tmp_path, stage_overrides(stage))
    _agrees(est, stage_runs(stage), 2)
    assert est["options"]["zero_stage"] == stage


def test_one_rank_zero_offload_shape_runs_and_estimates(job, tmp_path):
    """nproc=1 (ZeRO-Offload on one GPU is the real use): the run makes and releases its own
    one-rank process group (and DeepSpeed the groups it cached from it: the estimate's engine
    after it in this process builds on a fresh one), and the estimate agrees with it."""
    import torch.distributed as dist

    o = SHAPE + ["distributed=deepspeed", "distributed.nproc=1", "distributed.zero_stage=2",
                 "train.batch_size=2", "train.steps=2", "measure.memory_steps=all"]
    real = job(o)
    _ok(real)
    assert not dist.is_initialized()
    _agrees(_estimate(tmp_path, o), real, 1)
    assert not dist.is_initialized()
