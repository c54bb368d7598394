"""`logger=wandb`: what a W&B user reads back equals what memlab wrote, on an offline run read
from its transaction log (wandb's own protobuf records): the run summary is summary.json's
flattened values (not the last logged step), per-step rows carry the step's memory, and sweeps
get one group, short unique names and a tag for every varying override."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memlab_testing import FAST, choices_of, compose

pytest.importorskip("wandb")

from memlab.logger.base import RunInfo  # noqa: E402
from memlab.logger.wandb import (  # noqa: E402
    WandbLogger,
    measurements,
    run_names,
    settings,
    sweep_group,
    sweep_varying,
)
from wandb_offline import read_run, records, run_file  # noqa: E402


def _ctx(run_dir: Path, overrides: list[str]):
    from omegaconf import OmegaConf, open_dict

    from memlab.context import validate

    cfg = compose([*FAST, "logger=wandb", *overrides])
    choices = choices_of(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return validate(OmegaConf.create(OmegaConf.to_container(cfg)), run_dir, choices)


def _hydra_files(sweep: Path, job: int, overrides: list[str], task: list[str],
                 params: dict[str, str]) -> Path:
    """What Hydra writes before a sweep job runs: <sweep>/multirun.yaml, <job>/.hydra/."""
    import yaml

    sweep.mkdir(parents=True, exist_ok=True)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(
        {"hydra": {"overrides": {"task": task}, "sweeper": {"params": params}}}))
    run_dir = sweep / str(job)
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return run_dir


SUMMARY = {
    "status": "ok", "error": None,
    "choices": {"method": "sft", "peft": "lora"},
    "memory": {"peak_bytes": 123456789, "by_category": {"parameters": 1, "activations": 2},
               "by_phase": {"forward": 3, "backward": 4}, "cuda": None,
               "tracked_steps": [0, 1]},
    "throughput": {"tokens_per_s": 3747.8, "step_time_s": 0.25, "timed_steps": 2},
    "data": {"padding_fraction": 0.097, "fill_ratio": None},
    "train": {"final_loss": 7.25, "steps": 3, "loss_curve": [9.0, 8.0, 7.25]},
    "wall_time_s": 1.5,
}


@pytest.mark.pipeline
def test_summary_is_summary_json_and_steps_carry_memory(tmp_path):
    sweep = tmp_path / "multirun" / "2026-11-23" / "14-03-22"
    run_dir = _hydra_files(sweep, 1, ["peft=lora", "train.gradient_checkpointing=false"],
                           ["peft=lora", "train.gradient_checkpointing=true,false"], {})
    ctx = _ctx(run_dir, ["peft=lora", "train.gradient_checkpointing=false"])
    logger = ctx.logger.start(RunInfo.of(ctx, sweep), {"train": {"lr": 1e-3}})
    # the last step logs other values under the summary's own keys: they must not win
    for step in (1, 2, 3):
        metrics = {"train/loss": 10.0 - step, "throughput/tokens_per_s": 4295.4 + step,
                   "data/padding_fraction": 0.0}
        if step <= 2:
            metrics["memory/step_peak_bytes"] = 1000 * step
        logger.log(metrics, step=step)
    logger.finish(json.loads(json.dumps(SUMMARY)))

    got = read_run(run_file(run_dir))
    flat = measurements(SUMMARY)
    assert "memory/tracked_steps" not in flat and len(flat) == 16  # choices/* left out
    assert not any(k.startswith("choices/") for k in got["summary"])  # the config's, not here
    for key, value in flat.items():
        assert key in got["summary"], key
        assert got["summary"][key] == value, (key, got["summary"][key], value)
    assert got["summary"]["throughput/tokens_per_s"] == 3747.8  # not the last step's 4298.4
    steps = [row for row in got["history"] if "train/loss" in row]
    assert [row["_step"] for row in steps] == [1, 2, 3]
    assert [row.get("memory/step_peak_bytes") for row in steps] == [1000, 2000, None]
    run = got["run"]
    assert run.run_group == "2026-11-23_14-03-22"
    assert run.display_name == "gradient_checkpointing=false"
    # tagged with what the sweep varies only; peft=lora, the same in every job, is a config key
    assert run.tags == ["train.gradient_checkpointing:false"]
    assert json.loads(next(i.value_json for i in run.config.update if i.key == "train")) == \
        {"lr": 1e-3}


def test_names_are_short_and_unique_within_a_sweep(tmp_path):
    task = ["peft=none,lora", "train.gradient_checkpointing=true,false", "train.steps=3",
            "sweep=packing"]
    params = {"packing": "none,bfd", "method.max_length": "1024"}
    names = []
    for job, (peft, gc, packing) in enumerate(
            [(p, g, k) for p in ("none", "lora") for g in ("true", "false")
             for k in ("none", "bfd")]):
        sweep = tmp_path / "sw"
        run_dir = _hydra_files(sweep, job, [f"peft={peft}",
                                            f"train.gradient_checkpointing={gc}",
                                            "train.steps=3", "sweep=packing",
                                            f"packing={packing}", "method.max_length=1024"],
                               task, params)
        got = run_names(run_dir, sweep, {"sweep": "packing", "peft": peft})
        assert got["group"] == "packing-sw"
        assert [k for k, _ in got["varying"]] == ["peft", "train.gradient_checkpointing",
                                                  "packing"]
        names.append(got["name"])
    assert len(set(names)) == 8 and max(len(n) for n in names) <= 64, names
    assert names[3] == "peft=none,gradient_checkpointing=false,packing=bfd"
    assert sweep_varying(tmp_path / "sw") == ["peft", "train.gradient_checkpointing", "packing"]


def test_hydra_sweep_grammar_and_groups(tmp_path):
    _hydra_files(tmp_path, 0, ["train.lr=0.1"],
                 ["train.lr=range(1,3)", "peft=glob(*)", "model=tiny", "train.seed=choice(0,1)"],
                 {})
    assert sweep_varying(tmp_path) == ["train.lr", "peft", "train.seed"]
    assert sweep_varying(tmp_path / "absent") == []
    assert sweep_group(Path("/x/multirun/2026-01-02/03-04-05")) == "2026-01-02_03-04-05"
    assert sweep_group(Path("/x/my_sweep"), "zero") == "zero-my_sweep"
    single = run_names(_hydra_files(tmp_path / "one", 0, ["packing=bfd", "hydra.verbose=true"],
                                    [], {}).parent / "0", None, {})
    assert single == {"group": None, "name": "packing=bfd", "varying": [("packing", "bfd")]}


def test_wandb_settings_come_from_the_config_then_the_environment_then_memlab(tmp_path):
    """Each W&B setting: the config's value wins, else W&B's environment variable, else
    memlab's default; tags add up; the sources say which applied."""
    sweep = tmp_path / "sw"
    run_dir = _hydra_files(sweep, 0, ["peft=lora"], ["peft=none,lora"], {})
    info = RunInfo(run_dir, {"peft": "lora", "method": "sft"}, sweep)
    env = {"WANDB_PROJECT": "p-env", "WANDB_ENTITY": "e-env", "WANDB_TAGS": "x, y,",
           "WANDB_RUN_GROUP": "g-env", "WANDB_NAME": "n-env", "WANDB_MODE": "dryrun",
           "WANDB_NOTES": "why", "WANDB_JOB_TYPE": "train", "WANDB_DIR": str(tmp_path / "wd")}
    chosen, sources = settings(WandbLogger(), info, env)
    assert chosen == {"project": "p-env", "entity": "e-env", "mode": "offline",
                      "group": "g-env", "name": "n-env", "notes": "why", "job_type": "train",
                      "dir": str(tmp_path / "wd"),
                      "tags": ["x", "y", "peft:lora"]}  # what varies; method:sft does not
    assert sources["project"] == "env WANDB_PROJECT" and sources["mode"] == "env WANDB_MODE"
    assert sources["tags"] == "env WANDB_TAGS, memlab"
    mine = WandbLogger(project="p-cfg", mode="online", run_name="n-cfg", tags=["t"])
    chosen, sources = settings(mine, info, env)
    assert (chosen["project"], chosen["mode"], chosen["name"]) == ("p-cfg", "online", "n-cfg")
    assert chosen["entity"] == "e-env" and chosen["tags"][:3] == ["t", "x", "y"]
    assert sources["project"] == sources["mode"] == "config"
    chosen, sources = settings(WandbLogger(), info, {"WANDB_DISABLED": "true"})
    assert chosen["project"] == "memlab" and chosen["mode"] == "disabled"
    assert chosen["group"] == "sw" and chosen["name"] == "peft=lora"
    assert chosen["dir"] == str(run_dir) and chosen["entity"] is None
    assert sources["project"] == "memlab" and sources["entity"] == "wandb"


def test_an_invalid_job_is_a_wandb_run_with_its_status(tmp_path, monkeypatch):
    """A sweep's job rejected before it trains still records a W&B run, in the sweep's group
    and named like its siblings: the config as given, the status and reason in the summary, a
    failed exit; the environment's project applies."""
    from omegaconf import OmegaConf, open_dict

    from memlab.run import run

    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    overrides = ["optimizer.betas=[2,3]", "train.steps=0"]
    sweep = tmp_path / "sw"
    run_dir = _hydra_files(sweep, 2, overrides, ["train.steps=1,0", "optimizer.betas=[2,3]"], {})
    cfg = compose([*FAST, "logger=wandb", *overrides])
    choices = choices_of(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    summary = run(OmegaConf.create(OmegaConf.to_container(cfg)), run_dir, choices, overrides,
                  job={"num": 2, "sweep_dir": str(sweep)}, print_table=False)
    assert summary["status"] == "invalid"
    assert summary["logger"]["project"] == "from-env"
    assert summary["logger"]["sources"]["project"] == "env WANDB_PROJECT"
    got = read_run(run_file(Path(summary["run_dir"])))
    assert got["summary"]["status"] == "invalid"
    assert "betas" in got["summary"]["error"] and "train.steps" in got["summary"]["error"]
    assert got["run"].project == "from-env"
    assert got["run"].run_group == "sw" and got["run"].display_name == "steps=0"
    config = {i.key: json.loads(i.value_json) for i in got["run"].config.update}
    assert config["optimizer"]["betas"] == [2, 3]
    assert not any(k.startswith(("train/lr", "config/")) for k in got["summary"])
    exits = [r.exit for r in records(run_file(Path(summary["run_dir"])))
             if r.WhichOneof("record_type") == "exit"]
    assert exits and exits[-1].exit_code == 1
