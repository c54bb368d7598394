"""A mistyped command line is an error naming the fix (exit 2), and nothing runs: an option a
group does not have (Hydra runs the default of an optional group without a word), every value
of a sweep and a sweep file's options included; a key without ``+`` that the config does not
have (Hydra advises ``+``, the wrong fix); the names of transformers / TRL settings users type
first. The same through the other doors that compose a config: ``memlab estimate``, ``memlab
data show``, :func:`memlab.cli.compose.compose`, and the ``+key`` form (validation)."""

from __future__ import annotations

import pytest

from memlab.cli.main import main
from memlab.cli.overrides import problems
from memlab_testing import run_job
from reliability.helpers import SMOKE, memlab_popen

pytestmark = pytest.mark.integration


def _refused(capsys, tmp_path, args: list[str]) -> str:
    """Run ``memlab ARGS``; it must exit 2 before anything runs. Returns stderr."""
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    code = main([*args, f"hydra.run.dir={run}", f"hydra.sweep.dir={sweep}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not run.exists() and not sweep.exists(), "something ran"
    return err


@pytest.mark.parametrize("args,needle", [
    (["experiment=nope"], "experiment=nope: no such option (the options of experiment: "
                          "lean_sft, llama3.1_8b_lora_sft"),
    (["debug=smok"], "debug=smok: no such option; did you mean debug=smoke?"),
    (["-m", "sweep=foundatoin"], "sweep=foundatoin: no such option; did you mean "
                                 "sweep=foundation? (the options of sweep: data_parallel"),
    (["-m", "experiment=lean_sft,nope"], "experiment=nope: no such option"),
    (["method=dop"], "method=dop: no such option; did you mean method=dpo?"),
    (["+experiment=nope"], "experiment=nope: no such option"),
], ids=["experiment", "debug", "sweep", "a-swept-value", "a-required-group", "plus-form"])
def test_an_unknown_group_option_is_an_error_listing_the_options(capsys, tmp_path, args,
                                                                 needle):
    err = _refused(capsys, tmp_path, [*args, "train.steps=1"])
    assert needle in err, err


@pytest.mark.parametrize("arg,needle", [
    ("train.stepz=5", "train.stepz=5: unknown key; did you mean train.steps=5? (the keys of "
                      "train: batch_size"),
    ("method.max_lenght=512", "method.max_lenght=512: unknown key; did you mean "
                              "method.max_length=512?"),
    ("pef=lora", "pef=lora: unknown key; did you mean peft=lora?"),
    ("max_length=64", "max_length=64: unknown key; did you mean method.max_length=64?"),
    ("train.max_steps=5", "train.max_steps=5: max_steps is transformers' / TRL's name; "
                          "memlab's is train.steps: train.steps=5"),
    ("max_steps=5", "memlab's is train.steps: train.steps=5"),
    ("learning_rate=1e-4", "memlab's is train.lr: train.lr=0.0001"),
    ("train.per_device_train_batch_size=8", "memlab's is train.batch_size: "
                                            "train.batch_size=8"),
    ("gradient_accumulation_steps=4", "memlab's is train.grad_accum: train.grad_accum=4"),
    ("num_train_epochs=1", "num_train_epochs=1: num_train_epochs is transformers' / TRL's name; "
                           "memlab's is train.epochs: train.epochs=1 (whole passes over the "
                           "rows; exclusive with train.steps"),
])
def test_an_unknown_key_without_plus_gets_the_right_fix(capsys, tmp_path, arg, needle):
    err = _refused(capsys, tmp_path, ["debug=smoke", arg])
    assert needle in err, err
    assert "To append to your config use +" not in err  # Hydra's advice, the wrong fix


def test_every_problem_at_once_and_a_key_of_some_swept_options(capsys, tmp_path):
    err = _refused(capsys, tmp_path, ["-m", "debug=smok", "train.stepz=3", "method=sft,dpo",
                                      "method.beta=0.2"])
    assert "(3 problem(s))" in err, err
    assert "debug=smok: no such option" in err and "did you mean train.steps=3?" in err
    # a sweep's option with the key passes, the other would fail in Hydra's composition
    assert "method.beta=0.2: not a key of the job(s) with method=sft (only of the others)" in err
    assert problems(["-m", "method=dpo,kto", "method.beta=0.2"]) == []  # both have it


def test_the_other_commands_and_compose_refuse_the_same(capsys, tmp_path):
    from memlab.cli.compose import compose
    from memlab.cli.estimate import build_parser, estimate_one, options_from
    from memlab.registry import ConfigErrors

    assert main(["estimate", "experiment=nope", "--out", str(tmp_path / "est")]) == 2
    assert "experiment=nope: no such option" in capsys.readouterr().err
    assert not (tmp_path / "est").exists()
    assert main(["data", "show", "train.stepz=3"]) == 2
    assert "did you mean train.steps=3?" in capsys.readouterr().err
    with pytest.raises(ConfigErrors, match="debug=smok: no such option"):
        compose(["debug=smok"])
    with pytest.raises(ConfigErrors, match="memlab's is train.lr"):
        compose(["learning_rate=0.1"])
    est = estimate_one(["sweep=foundatoin"], options_from(build_parser().parse_args([])))
    assert est["status"] == "invalid" and "did you mean sweep=foundation?" in est["error"]


def test_the_plus_form_names_memlabs_key(tmp_path):
    s = run_job(tmp_path, [*SMOKE, "+train.max_steps=2", "+learning_rate=0.1",
                           "+train.num_train_epochs=1"], fast=False)
    assert s["status"] == "invalid" and "3 problem(s)" in s["error"], s["error"]
    assert ("train: unknown key 'max_steps'; max_steps is transformers' / TRL's name; memlab's "
            "is train.steps: train.steps=2") in s["error"]
    assert "unknown top-level key 'learning_rate'; learning_rate is transformers'" in s["error"]
    assert ("train: unknown key 'num_train_epochs'; num_train_epochs is transformers' / TRL's "
            "name; memlab's is train.epochs: train.epochs=1") in s["error"]


def test_a_sweep_files_unknown_option_refuses_the_sweep_before_any_job(tmp_path):
    """The options of a sweep file's ``hydra.sweeper.params`` reach the jobs past the command
    line's check: memlab's launcher checks every job's choices before it starts one."""
    mine = tmp_path / "configs" / "sweep" / "mine.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text("# @package _global_\nhydra:\n  sweeper:\n    params:\n"
                    "      experiment: lean_sft,nope\n")
    log, sweep = tmp_path / "sweep.log", tmp_path / "sweep"
    proc = memlab_popen(["-m", "--config-dir", str(tmp_path / "configs"), "sweep=mine",
                         f"hydra.sweep.dir={sweep}"], log)
    assert proc.wait(timeout=600) == 2, log.read_text()[-3000:]
    out = log.read_text()
    assert "sweep refused, no job started" in out and "job #1: experiment=nope: no such " \
        "option" in out, out[-3000:]
    assert not (sweep / "0").exists() and not (sweep / "1").exists()
