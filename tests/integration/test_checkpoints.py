"""Checkpoints: a Hugging Face directory you can load (full model, PEFT adapter, merged model,
reward model; from single and distributed runs), safe loading (no pickle runs code), honest
resume (the config is compared; allowed changes take effect and are recorded; ``latest`` finds
this config's newest checkpoint), pruning, and validation of the new knobs before any model
loads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from memlab.trainer import checkpoint
from memlab.trainer.routing import unwrap
from memlab_testing import FAST, LORA_CHUNKED, RUN, choices_of, compose

pytestmark = pytest.mark.integration

UNTRACKED = "measure.memory_steps=0"
"""For runs whose memory no test reads: every step timed, none under the tracker (~3x slower a
step); not a training setting, so not compared on resume (test_resume_refuses_... shows it)."""


def validated(tmp_path: Path, overrides: list[str], name: str = "run"):
    """The run context of the fast test config with ``overrides`` (nothing built)."""
    from omegaconf import OmegaConf, open_dict

    from memlab.context import validate

    switched = {o.split("=")[0] for o in overrides if "=" in o and "." not in o.split("=")[0]}
    cfg = compose([o for o in FAST if o.split(".")[0] not in switched] + overrides)
    choices = choices_of(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)),
                    tmp_path / name, choices)


def hf_files(ckpt: Path) -> set[str]:
    """The Hugging Face files of a checkpoint (not memlab's resume state, not DeepSpeed's)."""
    own = (checkpoint.STATE, checkpoint.STATE_TENSORS, checkpoint.OPTIMIZER,
           checkpoint.TRAINABLE, "latest", "zero_to_fp32.py", "zero_to_torch.py")
    return {p.name for p in ckpt.iterdir() if p.is_file() and p.name not in own}


def train_here(tmp_path: Path, overrides: list[str], name: str = "run"):
    """Validate + build + train in this process (as a run does) and save a checkpoint; returns
    (ctx, pipeline, checkpoint dir) so a test can compare the live trained model with what
    was saved."""
    from memlab import pipeline
    from memlab.run import seed_everything

    ctx = validated(tmp_path, overrides, name)
    seed_everything(ctx.train.seed)
    pipe = pipeline.build(ctx)
    pipe.trainer.train()
    return ctx, pipe, pipe.trainer.save_checkpoint()


IDS = torch.randint(5, 4000, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(model, ids=IDS) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def base_of(ctx, tokenizer, head: str = "causal_lm"):
    """The run's base model as it was before training (model=tiny: the same seeded init)."""
    return ctx.model.load(ctx, tokenizer, head, {})


# ---------------------------------------------------------------- a model you can load
def test_full_finetune_saves_a_model_that_loads_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ctx, pipe, ckpt = train_here(tmp_path, ["train.steps=2"])
    live = unwrap(pipe.models["policy"])
    files = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", checkpoint.STATE} <= files
    assert "state.pt" not in files and not any(f.endswith((".pt", ".bin")) for f in files)
    loaded = AutoModelForCausalLM.from_pretrained(
        ckpt, attn_implementation=live.config._attn_implementation)
    assert json.loads((ckpt / "config.json").read_text())["use_cache"] is True
    assert torch.equal(logits(loaded), logits(live))
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.get_vocab() == pipe.tokenizer.get_vocab()
    assert tok.chat_template == pipe.tokenizer.chat_template
    # the model files hold the trainable weights: not written a second time for resuming
    assert not (ckpt / checkpoint.TRAINABLE).exists()
    assert json.loads((ckpt / checkpoint.STATE).read_text())["export"]["kind"] == "model"


def test_lora_saves_an_adapter_and_a_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ctx, pipe, ckpt = train_here(tmp_path, ["peft=lora", "train.steps=2", "train.lr=1e-2",
                                            "train.save_merged=true", "train.save_final=true"])
    live = unwrap(pipe.models["policy"])
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in ckpt.iterdir()}
    assert not (ckpt / "model.safetensors").exists()  # the base is not duplicated
    attn = live.get_base_model().config._attn_implementation
    base = base_of(ctx, pipe.tokenizer)
    before = logits(base)
    adapter = PeftModel.from_pretrained(base, ckpt)
    trained = logits(live)
    assert torch.equal(logits(adapter), trained)
    assert not torch.allclose(before, trained, atol=1e-4)  # the adapter learned something
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "merged", attn_implementation=attn)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), trained, rtol=1e-4, atol=1e-4)


def test_reward_model_saves_a_sequence_classifier(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    ctx, pipe, ckpt = train_here(tmp_path, ["method=reward", "train.steps=2"], "full")
    live = unwrap(pipe.models["policy"])
    loaded = AutoModelForSequenceClassification.from_pretrained(
        ckpt, attn_implementation=live.config._attn_implementation)
    assert loaded.config.num_labels == 1
    assert torch.equal(logits(loaded), logits(live))

    ctx, pipe, ckpt = train_here(tmp_path, ["method=reward", "peft=lora", "train.steps=2"],
                                 "lora")
    live = unwrap(pipe.models["policy"])
    adapter = PeftModel.from_pretrained(base_of(ctx, pipe.tokenizer, "seq_cls"), ckpt)
    assert torch.equal(logits(adapter), logits(live))  # the trained score head came back too




@pytest.mark.slow
@pytest.mark.parametrize("o, dist", [
    (LORA_CHUNKED, ["distributed=ddp", "distributed.nproc=2"]),
    (RUN, ["distributed=fsdp2", "distributed.nproc=2"]),
    (LORA_CHUNKED, ["distributed=deepspeed", "distributed.nproc=2", "distributed.zero_stage=3"]),
], ids=["ddp-lora", "fsdp2-full", "zero3-lora"])
def test_distributed_runs_save_the_same_layout_from_rank_0(tmp_path, o, dist):
    """2 ranks x 2 rows train like 1 process x 4 rows: the Hugging Face directory rank 0
    writes (FSDP2 / ZeRO-3: gathered first) loads like the single run's, with its logits. (The
    runs are only read: :func:`memlab_testing.shared_job`'s, trained once per session for
    test_distributed.py and test_deepspeed.py too.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memlab._guards import has
    from memlab_testing import shared_job

    if "distributed=deepspeed" in dist and not has("deepspeed"):
        pytest.skip("needs the deepspeed extra")
    peft = "peft=lora" in o
    single, _ = shared_job(o + ["train.batch_size=4"])
    ranks, _ = shared_job(o + dist + ["train.batch_size=2"])
    for s in (single, ranks):
        assert s["status"] == "ok", s["error"]
    a, b = Path(single["train"]["checkpoint"]), Path(ranks["train"]["checkpoint"])
    assert hf_files(a) == hf_files(b)
    for ckpt in (a, b):  # every file hashed, DeepSpeed's shards of both ranks included
        hashed = json.loads((ckpt / checkpoint.STATE).read_text())["files"]
        on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
        assert set(hashed) == on_disk - {checkpoint.STATE}
        assert all(hashlib.sha256((ckpt / f).read_bytes()).hexdigest() == h
                   for f, h in hashed.items())
    if "distributed=deepspeed" in dist:
        assert {"deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(hashed)
    assert {"adapter_model.safetensors" if peft else "model.safetensors", "config.json"
            if not peft else "adapter_config.json", "tokenizer.json"} <= hf_files(b)
    if peft:
        ctx = validated(tmp_path, ["peft=lora"])
        tok = ctx.model.load_tokenizer(ctx)
        la = logits(PeftModel.from_pretrained(base_of(ctx, tok), a))
        lb = logits(PeftModel.from_pretrained(base_of(ctx, tok), b))
    else:
        la = logits(AutoModelForCausalLM.from_pretrained(a))
        lb = logits(AutoModelForCausalLM.from_pretrained(b))
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------ safe loading
class _Touch:
    """Unpickling this creates ``path``: a stand-in for a checkpoint that runs code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickle_that_would_run_code_is_refused(job, tmp_path):
    marker = tmp_path / "code_ran"
    crafted = tmp_path / "crafted" / "step_000002"
    crafted.mkdir(parents=True)
    torch.save({"step": 2, "weights": {}, "payload": _Touch(marker)}, crafted / "state.pt")
    s = job(["train.steps=4", f"train.resume_from={crafted}"])
    assert s["status"] == "invalid" and "pickled state.pt" in s["error"], s["error"]
    assert not marker.exists()
    # DeepSpeed's shards are pickles: every one is opened with weights_only=True first
    ds = tmp_path / "ds"
    ds.mkdir()
    torch.save({"module": {"w": torch.ones(2)}}, ds / "mp_rank_00_model_states.pt")
    checkpoint.check_pickles(ds)  # plain tensors and data pass
    torch.save({"optimizer": _Touch(marker)}, ds / "zero_pp_rank_0_optim_states.pt")
    with pytest.raises(checkpoint.CheckpointError, match="refused .*zero_pp_rank_0"):
        checkpoint.check_pickles(ds)
    assert not marker.exists()
    torch.load(ds / "zero_pp_rank_0_optim_states.pt", weights_only=False)  # the file is real:
    assert marker.exists()  # unpickled without the check, it runs its code


def test_a_damaged_or_foreign_file_is_refused_not_unpickled(job, tmp_path):
    straight = job(["train.steps=2", "train.save_final=true", "peft=lora", UNTRACKED])
    ckpt = Path(straight["train"]["checkpoint"])
    marker = tmp_path / "code_ran"
    torch.save({"x": _Touch(marker)}, ckpt / checkpoint.OPTIMIZER)  # a pickle in disguise
    s = job(["train.steps=3", "peft=lora", f"train.resume_from={ckpt}",
             "train.resume_allow=[train.steps]"])
    assert s["status"] == "invalid" and "not a readable safetensors file" in s["error"]
    assert not marker.exists()


def test_tensor_tree_round_trip():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
             "param_groups": [{"betas": (0.9, 0.999), "params": [0], "lr": float("inf")}],
             "rng": (3, tuple(range(5)), None), "np": ("MT", np.arange(4, dtype=np.uint32))}
    tensors: dict[str, torch.Tensor] = {}
    tree = json.loads(json.dumps(checkpoint.to_tree(state, tensors)))
    back = checkpoint.from_tree(tree, tensors)
    assert back["state"][0]["exp_avg"] is state["state"][0]["exp_avg"]
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["param_groups"][0]["lr"] == float("inf")
    assert back["rng"] == state["rng"]
    assert back["np"][1].dtype == np.uint32 and back["np"][1].tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------------ honest resume
def test_lora_resume_is_exact_and_saving_moves_nothing(job):
    """Saving (adapter, merged model, state) in the middle of a run changes nothing that
    follows; resuming from it gives the straight run's curve."""
    o = ["peft=lora", "train.steps=4", "train.lr=1e-2", "model.hidden_size=64", UNTRACKED]
    plain = job(o)
    saved = job(o + ["train.save_every=2", "train.save_merged=true"])
    assert saved["status"] == "ok", saved["error"]
    assert saved["train"]["loss_curve"] == plain["train"]["loss_curve"]
    ckpt = f"{saved['run_dir']}/checkpoints/step_000002"
    assert (Path(ckpt) / "merged" / "model.safetensors").is_file()
    resumed = job(o + [f"train.resume_from={ckpt}"])
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["train"]["loss_curve"] == plain["train"]["loss_curve"]
    assert resumed["train"]["curves"] == plain["train"]["curves"]
    assert resumed["resume"] == {"from": ckpt, "requested": ckpt, "step": 2, "changed": {},
                                 "verified": True}


def test_resume_refuses_every_training_difference_in_one_message(job):
    straight = job(["train.steps=4", "train.save_every=2"])
    ckpt = f"{straight['run_dir']}/checkpoints/step_000002"
    bad = job(["train.steps=4", "train.lr=1e-3", "train.seed=1", "method.max_length=96",
               "peft=lora", f"train.resume_from={ckpt}"])
    assert bad["status"] == "invalid"
    err = bad["error"]
    assert "1 problem(s)" in err  # one message ...
    for line in ("train.lr: 0.0003 (checkpoint) -> 0.001 (this run)",  # ... naming each
                 "train.seed: 0 (checkpoint) -> 1 (this run)",
                 "method.max_length: 128 (checkpoint) -> 96 (this run)",
                 'peft: "none" (checkpoint) -> "lora" (this run)'):
        assert line in err, err
    assert "train.resume_allow='[" in err and "peft.r" not in err
    # what cannot change training is not compared
    ok = job(["train.steps=4", "train.gradient_checkpointing=false", "measure.memory_steps=0",
              "train.progress=false", f"train.resume_from={ckpt}"])
    assert ok["status"] == "ok", ok["error"]
    assert ok["resume"]["changed"] == {}
    assert ok["train"]["loss_curve"] == straight["train"]["loss_curve"]


def test_allowed_changes_take_effect_and_are_recorded(job):
    o = ["train.steps=4", "train.scheduler=constant", UNTRACKED]
    straight = job(o + ["train.save_every=2"])
    ckpt = f"{straight['run_dir']}/checkpoints/step_000002"
    s = job(o + ["train.lr=1e-3", "train.weight_decay=0.1", f"train.resume_from={ckpt}",
                 "train.resume_allow=[train.lr,train.weight_decay]"])
    assert s["status"] == "ok", s["error"]
    assert s["resume"]["changed"] == {"train.lr": {"checkpoint": 3e-4, "run": 1e-3},
                                      "train.weight_decay": {"checkpoint": 0.0, "run": 0.1}}
    assert s["train"]["curves"]["train/lr"] == [3e-4, 3e-4, 1e-3, 1e-3]
    assert s["train"]["loss_curve"][:3] == straight["train"]["loss_curve"][:3]
    assert s["train"]["loss_curve"][3] != straight["train"]["loss_curve"][3]


def test_latest_is_the_newest_checkpoint_of_this_config(job):
    a = job(["train.steps=4", "train.save_every=2", UNTRACKED])  # seed 0: steps 2 and 4
    b = job(["train.steps=4", "train.save_every=2", "train.seed=1", UNTRACKED])  # newer, another
    assert a["status"] == b["status"] == "ok"
    s = job(["train.steps=6", "train.resume_from=latest", "train.resume_allow=[train.steps]",
             UNTRACKED])
    assert s["status"] == "ok", s["error"]
    assert s["resume"]["from"] == f"{a['run_dir']}/checkpoints/step_000004"
    assert s["resume"]["requested"] == "latest"
    assert s["config"]["train"]["resume_from"] == s["resume"]["from"]
    assert s["train"]["loss_curve"][:4] == a["train"]["loss_curve"]
    none = job(["train.steps=4", "train.lr=5e-4", "train.resume_from=latest"])
    assert none["status"] == "invalid"
    assert "no checkpoint of this configuration" in none["error"]
    assert "train.lr: 0.0003 (checkpoint) -> 0.0005 (this run)" in none["error"]


def test_keep_last_prunes_old_checkpoints(job):
    s = job(["train.steps=5", "train.save_every=1", "train.keep_last=2", "train.save_final=true",
             UNTRACKED])
    assert s["status"] == "ok", s["error"]
    kept = sorted(p.name for p in Path(s["run_dir"], "checkpoints").iterdir())
    assert kept == ["step_000004", "step_000005"]
    assert s["train"]["checkpoint"].endswith("step_000005")


def test_new_knobs_are_validated_before_any_model_loads(job):
    bad = job(["train.save_merged=true", "train.keep_last=0", "train.resume_allow=[train.lrr]"])
    assert bad["status"] == "invalid"
    for needle in ("train.save_merged=true merges a PEFT adapter", "nothing is saved",
                   "train.keep_last: must be", "did you mean 'train.lr'",
                   "train.resume_from is null"):
        assert needle in bad["error"], bad["error"]
    assert bad["memory"] is None  # rejected before anything was built
    missing = job([f"train.resume_from={Path(bad['run_dir']) / 'nowhere'}"])
    assert missing["status"] == "invalid" and "no such checkpoint directory" in missing["error"]


def test_resume_from_latest_through_the_cli(tmp_path):
    """``memlab`` (the Hydra app) run from a directory whose outputs/ holds an earlier run of
    the same configuration (trained in this process, into outputs/first, as the app would):
    it gets its own Hydra run dir under outputs/, and ``resume_from=latest`` finds the first
    run's checkpoint there."""
    import os
    import subprocess
    import sys

    from memlab_testing import run_job

    base = ["debug=smoke", *FAST, "measure.memory=false"]
    first = run_job(tmp_path / "outputs", base + ["train.steps=2", "train.save_final=true"],
                    fast=False, name="first")
    assert first["status"] == "ok", first["error"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    second = subprocess.run([sys.executable, "-m", "memlab", *base, "train.steps=3",
                             "train.resume_from=latest", "train.resume_allow=[train.steps]",
                             "hydra.run.dir=outputs/second"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads((tmp_path / "outputs" / "second" / "summary.json").read_text())
    assert summary["resume"]["from"] == str(tmp_path / "outputs/first/checkpoints/step_000002")
    assert summary["job"]["outputs"] == [str(tmp_path / "outputs"), str(tmp_path / "multirun")]
