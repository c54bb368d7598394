"""A run whose result would not be what was asked for is refused, or its record says so: a
micro-batch larger than the data; data that carries no training signal (hollow rows, reward
groups of zero variance); a resume of a training that is already complete; a resume whose data,
model, tokenizer or chat template changed in place since the checkpoint; a ``latest`` that has
to pass over a damaged newer checkpoint (in-process runs on tiny files)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from memlab_testing import run_job
from reliability.helpers import SMOKE

pytestmark = pytest.mark.integration

LOCAL = [o for o in SMOKE if not o.startswith("data.")]  # data.n_examples: embedded's
CHAT = [{"messages": [{"role": "user", "content": f"question {i}"},
                      {"role": "assistant", "content": f"answer number {i} " * 3}]}
        for i in range(8)]


def _file(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp_path, *overrides: str, name: str = "run") -> dict:
    return run_job(tmp_path, [*LOCAL, *overrides], fast=False, name=name)


# ------------------------------------------------------------------------------ batch size
def test_a_batch_larger_than_the_data_is_refused_with_the_rows(tmp_path):
    data = _file(tmp_path / "rows.jsonl", CHAT[:3])
    s = _run(tmp_path, "data=local", f"data.path={data}", "train.batch_size=4")
    assert s["status"] == "invalid", s["error"]
    assert s["error"].startswith("train.batch_size=4 asks for 4 rows per micro-batch, but the "
                                 "data has 3 rows after preparation (3 examples)")
    assert "Lower train.batch_size to 3 or less" in s["error"]
    assert s["data"]["rows"] == 3 and s["train"] is None  # refused before the model loads
    assert _run(tmp_path, "data=local", f"data.path={data}", "train.batch_size=3",
                "train.steps=1", name="fits")["status"] == "ok"


def test_a_batch_larger_than_the_packed_rows_is_refused(tmp_path):
    """Packing makes fewer rows than examples: the micro-batch is counted in packed rows."""
    s = _run(tmp_path, "data.n_examples=8", "packing=bfd", "method.max_length=16384")
    assert s["status"] == "invalid", s["error"]
    assert s["error"].startswith("train.batch_size=2 asks for 2 rows per micro-batch, but the "
                                 "data has 1 rows after preparation and packing (8 examples)")


def test_an_eval_batch_larger_than_the_held_out_rows_records_the_batch_that_ran(tmp_path):
    """Sibling through the evaluation door: 4 held-out rows under train.eval_batch_size=8 are
    one micro-batch of 4; the record says so (the eval loss is the same for any batch size,
    so the run goes on; before, ``eval.batch_size`` said 8)."""
    held = ["data.n_examples=16", "data.eval=0.25", "train.eval_every=3"]  # 4 held-out rows
    s = _run(tmp_path, *held, "train.eval_batch_size=8")
    assert s["status"] == "ok", s["error"]
    ev = s["eval"]
    assert (ev["batch_size"], ev["batch_size_asked"]) == (4, 8), ev
    assert "every evaluation micro-batch held at most 4" in ev["batch_note"]
    s = _run(tmp_path, *held, "train.eval_batch_size=4", name="fits")
    assert s["eval"]["batch_size"] == 4 and "batch_size_asked" not in s["eval"]


# ----------------------------------------------------------------------------- hollow data
def test_sft_rows_whose_every_assistant_turn_is_empty_are_refused(tmp_path):
    empty = [{"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": ""}]}] * 4
    s = _run(tmp_path, "data=local", f"data.path={_file(tmp_path / 'e.jsonl', empty)}")
    assert s["status"] == "invalid", s["error"]
    assert s["error"].startswith("the data has nothing to train on: all 4 examples are hollow "
                                 "(every assistant turn / completion is empty")
    assert s["data"]["hollow_rows"] == 4 and s["data"]["trainable_tokens"] > 0  # end-of-turn
    pc = [{"prompt": "q", "completion": " "}] * 2
    s = _run(tmp_path, "data=local", f"data.path={_file(tmp_path / 'pc.jsonl', pc)}",
             name="pc")
    assert s["status"] == "invalid" and "all 2 examples are hollow" in s["error"], s["error"]


def test_dpo_with_chosen_equal_to_rejected_is_refused(tmp_path):
    same = [{"prompt": f"q{i}", "chosen": "the same", "rejected": "the same"} for i in range(4)]
    s = _run(tmp_path, "method=dpo", "data=local",
             f"data.path={_file(tmp_path / 'same.jsonl', same)}")
    assert s["status"] == "invalid", s["error"]
    assert ("all 4 examples are hollow (pairs whose chosen and rejected tokens are the same "
            "(after truncation)") in s["error"]
    assert s["data"]["hollow_rows"] == 4 and s["data"]["empty_completions"] == 0


def test_a_truncation_that_cuts_the_difference_away_makes_pairs_hollow(tmp_path):
    """Sibling: chosen and rejected differ only after ``max_completion_length`` tokens."""
    rows = [{"prompt": "q", "chosen": "alike " * 20 + "yes", "rejected": "alike " * 20 + "no"}
            ] * 2
    s = _run(tmp_path, "method=dpo", "data=local", "method.max_completion_length=8",
             f"data.path={_file(tmp_path / 'cut.jsonl', rows)}")
    assert s["status"] == "invalid" and "all 2 examples are hollow" in s["error"], s["error"]


def test_mostly_hollow_data_trains_with_a_warning_above_the_threshold(tmp_path, capsys):
    rows = ([{"prompt": f"q{i}", "chosen": "same", "rejected": "same"} for i in range(3)]
            + [{"prompt": "r", "chosen": "yes indeed", "rejected": "no"}])
    path = _file(tmp_path / "mostly.jsonl", rows)
    s = _run(tmp_path, "method=dpo", "data=local", f"data.path={path}", "train.steps=1")
    assert s["status"] == "ok", s["error"]
    assert s["data"]["hollow_rows"] == 3
    warning = ("3 of 4 examples (75%) carry no training signal: pairs whose chosen and rejected "
               "tokens are the same")
    assert s["data"]["hollow_warning"].startswith(warning)
    assert "above data.max_hollow_fraction=0.5" in s["data"]["hollow_warning"]
    assert warning in capsys.readouterr().err
    quiet = _run(tmp_path, "method=dpo", "data=local", f"data.path={path}", "train.steps=1",
                 "data.max_hollow_fraction=0.8", name="quiet")
    assert quiet["status"] == "ok" and quiet["data"]["hollow_rows"] == 3
    assert "hollow_warning" not in quiet["data"]


def test_reward_groups_of_zero_variance_are_counted_and_warned(tmp_path):
    """GRPO's default reward (``length``) on a tiny random model that never ends a completion
    early: every completion has the same length, so every group's rewards are equal."""
    smoke = [o for o in LOCAL if not o.startswith("method.")]
    s = run_job(tmp_path, [*smoke, "method=grpo", "data.n_examples=8", "train.steps=1",
                           "method.num_generations=2", "method.max_completion_length=4"],
                fast=False)
    assert s["status"] == "ok", s["error"]
    assert s["data"]["groups"] == 2 and s["data"]["hollow_groups"] == 2
    assert s["data"]["hollow_groups_warning"].startswith(
        "2 of 2 reward groups (100%) had rewards of zero variance: their advantages are zero")
    assert "no group carried a signal" in s["data"]["hollow_groups_warning"]


# -------------------------------------------------------------------------------- resuming
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run over a local file that saved a checkpoint at each of its 3 steps."""
    root = tmp_path_factory.mktemp("saved")
    data = _file(root / "rows.jsonl", CHAT)
    o = ["data=local", f"data.path={data}", "train.steps=3", "train.save_every=1"]
    s = run_job(root, [*LOCAL, *o], fast=False)
    assert s["status"] == "ok", s["error"]
    return root, o


def _copy(saved, tmp_path) -> Path:
    root, _ = saved
    shutil.copytree(root / "run" / "checkpoints", tmp_path / "old" / "checkpoints")
    return tmp_path / "old" / "checkpoints"


def test_resuming_a_finished_training_is_refused_with_the_step_reached(saved, tmp_path):
    root, o = saved
    ckpt = root / "run" / "checkpoints" / "step_000003"
    s = _run(tmp_path, *o, f"train.resume_from={ckpt}")
    assert s["status"] == "invalid", s["error"]
    assert (f"{ckpt} is at step 3, and train.steps=3: that training is already complete "
            f"(its record: {root / 'run' / 'summary.json'})") in s["error"]
    assert "train.resume_allow='[train.steps]'" in s["error"]
    assert s["train"] is None and s["memory"] is None  # no '0 of 3 steps', no 0 MiB peak
    latest = _run(tmp_path, *o, "train.resume_from=latest", f"train.resume_root={root}",
                  name="latest")
    assert latest["status"] == "invalid" and "is at step 3, and train.steps=3" in \
        latest["error"], latest["error"]
    more = _run(tmp_path, *o, "train.resume_from=latest", f"train.resume_root={root}",
                "train.steps=4", "train.resume_allow=[train.steps]", name="more")
    assert more["status"] == "ok" and more["resume"]["step"] == 3, more["error"]


def test_data_changed_in_place_is_refused_a_copy_resumes(saved, tmp_path):
    root, o = saved
    data = root / "rows.jsonl"
    ckpt = root / "run" / "checkpoints" / "step_000001"
    original = data.read_bytes()
    try:
        os.utime(data, ns=(1, 1))  # touched: another time, the same content
        touched = _run(tmp_path, *o, f"train.resume_from={ckpt}", name="touched")
        assert touched["status"] == "ok", touched["error"]
        data.write_bytes(original.replace(b"answer number 5", b"answer number 6"))
        s = _run(tmp_path, *o, f"train.resume_from={ckpt}", name="changed")
        assert s["status"] == "invalid", s["error"]
        assert (f"inputs.data: \"{data} ({len(original)} bytes, sha256 ") in s["error"]
        assert "train.resume_allow='[inputs.data]'" in s["error"]
        allowed = _run(tmp_path, *o, f"train.resume_from={ckpt}",
                       "train.resume_allow=[inputs.data]", name="allowed")
        assert allowed["status"] == "ok", allowed["error"]
        assert "inputs.data" in allowed["resume"]["changed"]
    finally:
        data.write_bytes(original)
    copy = tmp_path / "elsewhere" / "rows.jsonl"
    copy.parent.mkdir()
    shutil.copy(data, copy)
    moved = _run(tmp_path, *[x for x in o if not x.startswith("data.path")],
                 f"data.path={copy}", f"train.resume_from={ckpt}",
                 "train.resume_allow=[data.path]", name="copied")
    assert moved["status"] == "ok", moved["error"]
    assert set(moved["resume"]["changed"]) == {"data.path"}


def test_a_held_out_file_changed_in_place_is_refused(tmp_path):
    """Sibling through the held-out door: ``data.eval=<file>`` is fingerprinted too
    (``inputs.data.eval``), so a best evaluation is never compared across two held-out sets."""
    data, held = _file(tmp_path / "rows.jsonl", CHAT), _file(tmp_path / "val.jsonl", CHAT[:4])
    o = ["data=local", f"data.path={data}", f"data.eval={held}", "train.eval_every=1",
         "train.steps=2", "train.save_every=1"]
    assert _run(tmp_path, *o)["status"] == "ok"
    ckpt = f"train.resume_from={tmp_path / 'run' / 'checkpoints' / 'step_000001'}"
    _file(held, CHAT[4:8])
    s = _run(tmp_path, *o, ckpt, name="changed")
    assert s["status"] == "invalid", s["error"]
    assert f"inputs.data.eval: \"{held} (" in s["error"] and "inputs.data:" not in s["error"]
    assert _run(tmp_path, *o, ckpt, "train.resume_allow=[inputs.data.eval]",
                name="allowed")["status"] == "ok"


def test_a_model_dir_tokenizer_or_template_changed_in_place_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from memlab.data.assets import load_tokenizer
    from memlab.model.tiny import Tiny

    model = tmp_path / "model"
    tok = load_tokenizer()
    cfg = Tiny(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
               num_kv_heads=1).hf_config(tok)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model)
    tok.save_pretrained(model)
    template = tmp_path / "chat.jinja"
    template.write_text(tok.chat_template)
    o = [o for o in LOCAL if not o.startswith("model.")] + [
        "model=hf", f"model.name_or_path={model}", "model.local_files_only=true",
        f"model.chat_template={template}", "train.steps=2", "train.save_every=1"]
    s = run_job(tmp_path, o, fast=False)
    assert s["status"] == "ok", s["error"]
    ckpt = f"train.resume_from={tmp_path / 'run' / 'checkpoints' / 'step_000001'}"

    def refused(name: str, change) -> str:
        change()
        r = run_job(tmp_path, [*o, ckpt], fast=False, name=name)
        assert r["status"] == "invalid", r["error"]
        return r["error"]

    err = refused("template", lambda: template.write_text(tok.chat_template + "{# new #}"))
    assert f"inputs.chat_template: \"{template} (" in err
    config = json.loads((model / "tokenizer_config.json").read_text())
    err = refused("tokenizer", lambda: (model / "tokenizer_config.json").write_text(
        json.dumps({**config, "model_max_length": 77})))
    assert "inputs.tokenizer:" in err and "tokenizer_config.json" in err
    assert "inputs.model" not in err  # the weights did not change
    again = AutoModelForCausalLM.from_pretrained(model)
    again.get_input_embeddings().weight.data += 1  # other weights in the same files
    err = refused("weights", lambda: again.save_pretrained(model))
    assert "inputs.model:" in err and "model.safetensors" in err
    assert "train.resume_allow='[inputs.chat_template,inputs.model,inputs.tokenizer]'" in err


def test_a_hub_revision_that_moved_is_a_difference(tmp_path):
    """Hub data and models: the commit the revision resolved to in the hub cache."""
    from memlab.trainer import inputs

    ref = tmp_path / "datasets--org--set" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("a" * 40)
    inp = inputs.Inputs(repo="datasets/org/set", hub_cache=tmp_path)
    recorded = inputs.record({"data": inp})["data"]
    assert recorded == {"repo": "datasets/org/set", "revision": "a" * 40}
    assert inputs.changed(recorded, inp)[0] is False
    ref.write_text("b" * 40)
    differs, now = inputs.changed(recorded, inp)
    assert differs and now["revision"] == "b" * 40
    assert inputs.describe(recorded, now) == (f"datasets/org/set@{'a' * 40}",
                                              f"datasets/org/set@{'b' * 40}")


def test_latest_names_the_damaged_newer_checkpoints_it_skips(saved, tmp_path, capsys):
    _, o = saved
    checkpoints = _copy(saved, tmp_path)
    (checkpoints / "step_000003" / "optimizer.safetensors").unlink()
    state = checkpoints / "step_000002" / "memlab_state.json"
    state.write_text(state.read_text()[:100])  # a half-written state
    os.utime(checkpoints / "step_000002", None)  # (written after the one resumed)
    s = _run(tmp_path, *o, "train.steps=4", "train.resume_allow=[train.steps]",
             "train.resume_from=latest", f"train.resume_root={tmp_path / 'old'}")
    assert s["status"] == "ok", s["error"]
    assert s["resume"]["step"] == 1 and s["resume"]["from"].endswith("step_000001")
    skipped = {Path(k["checkpoint"]).name: k["why"] for k in s["resume"]["skipped"]}
    assert set(skipped) == {"step_000003", "step_000002"}
    assert "optimizer.safetensors is missing" in skipped["step_000003"]
    assert "memlab_state.json is not valid JSON" in skipped["step_000002"]
    err = capsys.readouterr().err
    assert "train.resume_from=latest: skipped" in err and "step_000003" in err
