"""`distributed=ddp` on CPU with real torch.distributed (gloo, 2 worker processes started by
memlab's launcher): N ranks x batch B trains exactly like one process with batch N*B (same
loss curve, same final weights), through every way a method calls the model (full logits,
the chunked loss's decoder call, LoRA, reward's packed scoring; DPO's reference in
test_preference_packing.py); each rank's memory is measured and merged; failures and invalid
setups are reported like any run's. Each topology trains once per session (``RUN``,
:func:`memlab_testing.shared_job`) and every test that checks it reads that run."""

from __future__ import annotations

import pytest
import torch

from memlab.trainer.batch import BatchStream
from memlab.trainer.checkpoint import read_weights
from memlab.trainer.routing import Routed, call_inside, unwrap
from memlab_testing import DDP, FSDP2, LORA_CHUNKED, RUN
from memlab_testing import STANDARD_LOSS as STANDARD

pytestmark = pytest.mark.integration


def _single() -> dict:
    """The one process with the global batch (4 rows) every topology here is compared with."""
    from memlab_testing import shared_job

    return shared_job(RUN + ["train.batch_size=4"])[0]


def _ranks(dist: list[str], batch: tuple[str, ...] = ("train.batch_size=2",)) -> dict:
    """RUN on 2 ranks (``dist``), 2 rows each unless ``batch`` says otherwise."""
    from memlab_testing import shared_job

    return shared_job(RUN + dist + list(batch))[0]


def _weights(summary) -> dict[str, torch.Tensor]:
    step = summary["train"]["steps"]
    return read_weights(f"{summary['run_dir']}/checkpoints/step_{step:06d}")


def _same_training(single, ddp, rel=2e-5):
    assert single["status"] == "ok", single["error"]
    assert ddp["status"] == "ok", ddp["error"]
    assert ddp["train"]["loss_curve"] == pytest.approx(single["train"]["loss_curve"], rel=rel)
    assert ddp["data"]["tokens_trained"] == single["data"]["tokens_trained"]


def test_two_ranks_of_two_rows_train_like_one_process_of_four():
    single, ddp = _single(), _ranks(DDP)
    _same_training(single, ddp)
    w1, w2 = _weights(single), _weights(ddp)
    assert w1.keys() == w2.keys()  # checkpoints name parameters without wrapper prefixes
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)  # Adam: ~1e-6 noise
    # every rank measured itself: same replica, half the batch -> fewer activation bytes
    ranks = ddp["distributed"]["ranks"]
    assert len(ranks) == 2 and all(r["status"] == "ok" for r in ranks)
    for r in ranks:
        assert r["by_category"]["parameters"] == single["memory"]["by_category"]["parameters"]
        assert r["peak_bytes"] < single["memory"]["peak_bytes"]
    assert ddp["memory"]["peak_bytes_max_rank"] == max(r["peak_bytes"] for r in ranks)
    # DDP's gradient buckets (outside the tracker) hold every trainable gradient
    grad_bytes = single["memory"]["by_phase_category"]["optimizer"]["gradients"]
    assert ranks[0]["wrapper"]["bucket_bytes"] == grad_bytes
    assert ranks[0]["wrapper"]["gradient_as_bucket_view"] is True
    assert ddp["throughput"]["note"] == "summed over 2 ranks"


def test_grad_accumulation_across_ranks(job):
    """2 ranks x 2 micro-batches of 1 row (no_sync on the first) == 1 process x 4 rows. The
    ranks split the 7 held-out rows, 3 a batch each: 3 + 3, then 1 + none (that rank runs a row
    again without counting it: its wrapper's forward may be a collective), and sum: the eval
    loss is the one process's."""
    o = ["train.steps=3", "data.eval=0.22", "train.eval_batch_size=3"]
    single = job(o + ["train.batch_size=4"])
    ddp = job(o + DDP + ["train.batch_size=1", "train.grad_accum=2"])
    _same_training(single, ddp)
    assert single["eval"]["examples"] == ddp["eval"]["examples"] == 7
    assert ddp["eval"]["final"]["loss"] == pytest.approx(single["eval"]["final"]["loss"],
                                                         rel=2e-5)
    assert "eval" in ddp["memory"]["by_phase"]




@pytest.mark.parametrize("dist", [DDP, FSDP2], ids=["ddp", "fsdp2"])
@pytest.mark.parametrize("o", [
    LORA_CHUNKED,
    ["train.steps=3", "method=reward", "method.padding_free=true", "method.max_length=96",
     "data.median_tokens=48"],
], ids=["lora-chunked", "reward-padding-free"])
def test_every_model_call_path_syncs(o, dist):
    """Chunked loss and packed reward scoring call parts of the model; they run inside the
    wrapper's forward (call_inside), or gradients would not be synchronised (DDP) or the
    sharded parameters not gathered (FSDP2), and the runs would differ or fail. (DDP and
    FSDP2 compare with the same one-process run. DPO's reference copy, packed, under DDP and
    FSDP2: test_preference_packing.py's test_packed_shared_runs_train_like_the_padded_run.)"""
    from memlab_testing import shared_job

    single, _ = shared_job(o + ["train.batch_size=4"])
    multi, _ = shared_job(o + dist + ["train.batch_size=2"])
    _same_training(single, multi, rel=1e-4)


def test_fsdp2_shards_parameters_gradients_and_optimizer_state():
    """2 ranks x 2 rows under FSDP2 == 1 process x 4 rows, and each rank holds half of the
    parameters and optimizer state (measured by each rank's tracker). The one process is
    the DDP test's."""
    single, sharded = _single(), _ranks(FSDP2)
    _same_training(single, sharded)
    one = single["memory"]["by_phase_category"]["optimizer"]
    for r in sharded["distributed"]["ranks"]:
        assert r["status"] == "ok"
    mine = sharded["memory"]["by_phase_category"]["optimizer"]
    # even split of every parameter's first dimension: exactly half here (all dims are even)
    assert mine["gradients"] == pytest.approx(one["gradients"] / 2, rel=0.01)
    # Adam's moments, read at each run's peak (a backward, the moments already allocated). Not
    # at the optimizer phase's peak: on gloo the last reduce-scatter's input is released by
    # the worker thread, sometimes only after the optimizer phase began; that moves the
    # phase's peak to its start, before foreach's temporaries (seen once in 4 runs on 2 busy
    # cores: optimizer 2393428 + 2 MiB of that buffer, instead of 3442132 with temporaries)
    assert sharded["memory"]["by_category"]["optimizer"] == pytest.approx(
        single["memory"]["by_category"]["optimizer"] / 2, rel=0.01)
    assert sharded["memory"]["by_category"]["optimizer"] > 0
    assert sharded["memory"]["by_category"]["parameters"] < single["memory"]["by_category"][
        "parameters"]
    assert sharded["memory"]["distributed"]["units"] == 2 + 1  # 2 decoder layers + root
    accum = _ranks(FSDP2, ("train.batch_size=1", "train.grad_accum=2"))
    _same_training(single, accum)


def test_fsdp2_steps_each_shard_inside_backward(job):
    """optimizer.in_backward under FSDP2: each rank steps its reduced shard in the hook FSDP2
    calls after the reduce-scatter; the same loss curve and weights as one process stepping
    after backward (no clipping), and no gradient left at the optimizer phase."""
    o = ["train.steps=3", "train.max_grad_norm=null", "train.save_final=true"]
    single = job(o + ["train.batch_size=4"])
    sharded = job(o + FSDP2 + ["train.batch_size=2", "optimizer.in_backward=true"])
    _same_training(single, sharded)
    w1, w2 = _weights(single), _weights(sharded)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= 1e-5
    assert sharded["memory"]["by_phase_category"]["optimizer"]["gradients"] == 0


@pytest.mark.parametrize("dist", [DDP, FSDP2], ids=["ddp", "fsdp2"])
def test_resume_gives_the_same_run(job, dist):
    """Resume the shared run's step-2 checkpoint (FSDP2: gathered from the shards, written by
    rank 0) to step 4: the same loss curve and final weights as the straight run."""
    straight = _ranks(dist)
    assert straight["status"] == "ok", straight["error"]
    ckpt = f"{straight['run_dir']}/checkpoints/step_000002"
    resumed = job(RUN + dist + ["train.batch_size=2", f"train.resume_from={ckpt}"])
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["train"]["loss_curve"] == pytest.approx(straight["train"]["loss_curve"],
                                                           rel=1e-5)
    w1, w2 = _weights(straight), _weights(resumed)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-7)
    if dist is FSDP2:  # a sharded checkpoint cannot be resumed by a replicated run
        bad = job(["train.steps=4", f"train.resume_from={ckpt}"])  # refused before loading
        assert bad["status"] == "invalid" and "written by a sharded run" in bad["error"]


def _estimate(tmp_path, name: str, overrides: list[str]) -> dict:
    """``memlab estimate`` of RUN (2 rows a process) with ``overrides``: its estimate.json."""
    import json

    from memlab.cli.estimate import main as estimate_main
    from memlab_testing import with_fast

    assert estimate_main([*with_fast(overrides), "--out", str(tmp_path / name)]) == 0
    return json.loads((tmp_path / name / "estimate.json").read_text())


def test_estimate_of_a_ddp_run_is_one_rank_with_resident_buckets(tmp_path):
    """DDP stays a model (its C++ reducer reads tensor data, see memlab.estimate.sharding): one
    plain process plus DDP's resident gradient-sized buckets, nothing else changed per rank. Its
    peak against a real 2-rank run (RUN: long rows cut at max_length, loss on every token: the
    estimate's worst case) is off by the error the estimate prints, DDP_MODEL_ERROR."""
    from memlab.estimate.sharding import DDP_MODEL_ERROR

    shape = RUN + ["train.batch_size=2"]
    # the DDP run's auto loss is the standard one, and so is its estimate as one process
    # (the method pinned before its distributed option is modelled away)
    auto = _estimate(tmp_path, "auto", [o for o in shape if o != STANDARD] + DDP)
    ddp_opts = DDP  # gradient_as_bucket_view=true (=false: the same peak, measured by hand)
    one = _estimate(tmp_path, "single", shape)
    ddp = _estimate(tmp_path, "ddp", shape + ddp_opts)
    assert ddp["sharding"] == {"world_size": 2, "zero_stage": 0}
    grads = one["by_phase_category"]["optimizer"]["gradients"]
    assert ddp["by_phase_category"]["forward"]["gradients"] == grads  # buckets resident
    assert one["by_phase_category"]["forward"]["gradients"] == 0
    for cat in ("parameters", "optimizer", "activations"):  # per rank: nothing else changes
        assert ddp["by_phase_category"]["backward"][cat] == \
            one["by_phase_category"]["backward"][cat]
    assert any("one rank of 2, estimated as one plain process" in a for a in ddp["assumptions"])
    assert any(f"measured error: {100 * DDP_MODEL_ERROR:+.2f}%" in a
               for a in ddp["assumptions"])
    assert auto["by_phase_category"] == ddp["by_phase_category"]
    real = _ranks(ddp_opts)
    assert real["status"] == "ok", real["error"]
    ep, rp = ddp["peak_bytes"], real["memory"]["peak_bytes_max_rank"]
    print(f"\n[ddp] estimate {ep} real (largest rank) {rp} {100 * (ep - rp) / rp:+.2f}%")
    assert (ep - rp) / rp == pytest.approx(DDP_MODEL_ERROR, abs=0.002)  # the printed error


def test_fsdp2_estimate_measures_a_rank_of_the_real_wrap(tmp_path):
    """distributed=fsdp2 is estimated by running its real wrap (fully_shard) on the fake
    weights over torch's fake process group: each rank's shards are measured, not divided, and
    the rank's peak equals a real 2-rank CPU run's (its tracker, like the estimate's, sees the
    shards; FSDP2's gathered layers live in storage it resizes in place)."""
    shape = RUN + ["train.batch_size=2"]
    one = _estimate(tmp_path, "single", shape)
    fsdp = _estimate(tmp_path, "fsdp2", shape + FSDP2)
    assert fsdp["sharding"] == {"world_size": 2, "zero_stage": 3}
    assert any("rank 0 of 2 measured" in a for a in fsdp["assumptions"])
    for cat in ("parameters", "optimizer"):  # Adam's moments and the weights: half per rank
        assert fsdp["by_phase_category"]["forward"][cat] == pytest.approx(
            one["by_phase_category"]["forward"][cat] / 2, rel=0.01)
    real = _ranks(FSDP2)
    assert real["status"] == "ok", real["error"]
    rp, ep = real["memory"]["peak_bytes_max_rank"], fsdp["peak_bytes"]
    print(f"\n[fsdp2] estimate {ep} real (largest rank) {rp} {100 * (ep - rp) / rp:+.2f}%")
    assert abs(ep - rp) <= 0.01 * rp
    for cat in ("parameters", "gradients", "optimizer", "activations"):
        assert fsdp["by_phase_category"]["backward"][cat] == pytest.approx(
            real["memory"]["by_phase_category"]["backward"][cat], rel=0.01, abs=64 * 1024)


def test_failing_ranks_fail_the_run_with_their_error(job, monkeypatch):
    # every rank crashes preparing its data (the launching process prepares none)
    monkeypatch.setenv("MEMLAB_FAULT_AT", "data")
    bad = job(DDP)
    assert bad["status"] == "failed"
    assert "InjectedFault" in bad["error"], bad["error"]
    assert bad["error"].startswith("RankFailed: rank 0 failed:")
    assert [r["status"] for r in bad["distributed"]["ranks"]] == ["failed", "failed"]


def test_invalid_setup_is_rejected_before_any_rank_starts(job):
    bad = job(DDP + ["distributed.backend=nccl"])
    assert bad["status"] == "invalid"
    assert "distributed.backend=nccl needs CUDA" in bad["error"]
    from pathlib import Path

    assert not (Path(bad["run_dir"]) / "ranks").exists()


def test_batch_stream_shards_are_the_single_process_batches():
    rows = [{"i": [k]} for k in range(10)]

    class DS(list):
        def __getitem__(self, idx):
            return {"i": [rows[j]["i"] for j in idx]}

    ds = DS(rows)
    one = BatchStream(ds, 4, 0, collate=lambda r: [x["i"][0] for x in r])
    two = [BatchStream(ds, 2, 0, collate=lambda r: [x["i"][0] for x in r], shard=(k, 2))
           for k in range(2)]
    for _ in range(5):  # across the epoch boundary (10 rows, global batch 4)
        assert next(one) == next(two[0]) + next(two[1])


def test_call_inside_runs_through_the_wrapper():
    lin = torch.nn.Linear(3, 2)
    routed = torch.nn.Module()
    routed.module = Routed(lin)  # what DDP(Routed(model)) looks like to call_inside
    routed.forward = lambda *a, **k: routed.module(*a, **k)
    x = torch.ones(1, 3)
    seen = []

    def part(model, x):
        seen.append(model)
        return model(x)

    torch.testing.assert_close(call_inside(routed, part, x), lin(x))
    assert seen == [lin] and unwrap(routed) is lin
    assert call_inside(lin, part, x).shape == (1, 2)


def test_sweep_over_single_and_ddp_with_report(tmp_path):
    """A DDP job inside a real Hydra multirun (isolating launcher): one job dir per job, the
    ranks under it, and `memlab report` reads both jobs."""
    import json
    import os
    import subprocess
    import sys

    from memlab_testing import FAST, REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    sweep = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "-m", "memlab", "-m", *FAST, "train.steps=2",
                        "distributed=single,ddp",  # ddp: 2 ranks on CPU by default
                        f"hydra.sweep.dir={sweep}"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    single, ddp = (json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1))
    assert single["status"] == ddp["status"] == "ok", (single["error"], ddp["error"])
    assert "distributed" not in single and len(ddp["distributed"]["ranks"]) == 2
    assert sorted(p.name for p in (sweep / "1" / "ranks").glob("rank*.json")) == \
        ["rank0.json", "rank1.json"]
    r = subprocess.run([sys.executable, "-m", "memlab.cli.main", "report", str(sweep), "--out",
                        str(tmp_path / "report")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ddp" in (tmp_path / "report" / "report.md").read_text()


def test_torchrun_launch_meets_in_rank0_dir(tmp_path):
    """Started by torchrun (as across nodes), every process is a rank: the ranks meet in rank
    0's run dir even when each rank's Hydra names its own (``${now:}`` with microseconds),
    and the merged run trains like one process with the global batch (RUN's, shared)."""
    import json
    import os
    import subprocess
    import sys
    import time

    from memlab_testing import REPO, with_fast

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("MEMLAB_RANK", None)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "-m", "memlab", *with_fast(RUN + ["train.batch_size=2"])]
    r = subprocess.run([*args, "distributed=ddp",
                        f"hydra.run.dir={tmp_path}/runs/${{now:%H-%M-%S-%f}}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 1, dirs  # rank 1's own empty Hydra dir is gone
    s = json.loads((dirs[0] / "summary.json").read_text())
    assert s["status"] == "ok" and len(s["distributed"]["ranks"]) == 2
    single = _single()
    assert s["train"]["loss_curve"] == pytest.approx(single["train"]["loss_curve"], rel=2e-5)
    # rank 0 still checks when rank 1 has found the problem: rank 1 waits for rank 0 to record
    # it (a rank that exited first would make torchrun stop rank 0: "interrupted")
    pause = tmp_path / "pause"
    log = tmp_path / "bad.log"
    with log.open("w") as err:
        bad = subprocess.Popen([*args, f"hydra.run.dir={tmp_path}/bad"], cwd=REPO,
                               env={**env, "MEMLAB_PAUSE_AT": "check:rank0",
                                    "MEMLAB_PAUSE_DIR": str(pause)},
                               stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 240
            while not (list(pause.glob("check:rank0.*.json"))
                       and "rank 0 records it" in log.read_text()):
                assert bad.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
            (pause / "check:rank0.go").touch()
            assert bad.wait(timeout=240) != 0
        finally:
            bad.kill()
    s = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert s["status"] == "invalid" and "use distributed=ddp or distributed=fsdp2" in s["error"]


FSDP2_GENERATION = r"""
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from transformers import LlamaConfig, LlamaForCausalLM
from memlab.trainer.routing import call_inside
from memlab.distributed.fsdp2 import FSDP2
class Ctx:
    is_cuda, world_size = False, 1
for gather in (True, False):  # the same model each time, in this one process group
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=128))
    opt = FSDP2(gather_for_generation=gather)
    w = opt.wrap(m, Ctx)
    kinds = lambda: sorted({type(p).__name__ for p in m.model.layers[0].parameters()})
    with torch.no_grad(), opt.generation(w):
        out = call_inside(w, lambda mm, **kw: mm.generate(**kw),
                          input_ids=torch.arange(10).view(2, 5), max_new_tokens=6,
                          do_sample=False, pad_token_id=0)
        inside = kinds()
    print(int(gather), inside, kinds(), out.tolist())
"""


def test_fsdp2_gather_for_generation_keeps_units_gathered_for_the_whole_call():
    """With the toggle a decoder layer stays gathered (plain parameters) after the decoding
    steps until the call ends, then is sharded again (DTensor); without it, every forward
    reshards it. The tokens are the same either way (one rank, its own process group; both
    wraps in one process)."""
    import subprocess
    import sys

    from memlab_testing import REPO

    proc = subprocess.run([sys.executable, "-c", FSDP2_GENERATION], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln[:2] in ("1 ", "0 ")]
    got = {ln[0]: ln[2:] for ln in lines}
    assert len(lines) == 2 and set(got) == {"1", "0"}, proc.stdout[-3000:]
    assert got["1"].startswith("['Parameter'] ['DTensor']"), got["1"]
    assert got["0"].startswith("['DTensor'] ['DTensor']"), got["0"]
    assert got["1"].split("]", 2)[2] == got["0"].split("]", 2)[2]  # the same tokens
