"""Bad input files are ``invalid`` (exit 2), and the error names the file and what is wrong:
data that is not UTF-8 or holds a lone surrogate escape (file and line), a damaged checkpoint
(a missing optimizer state, truncated weights), a damaged model directory (no tokenizer, a
truncated config.json or weight file); and ``memlab report`` lists a sweep's job that left no
record as ``missing`` with its overrides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memlab.record import exit_code
from memlab_testing import run_job
from reliability.helpers import SMOKE

pytestmark = pytest.mark.integration

LOCAL = [o for o in SMOKE if not o.startswith("data.")]


def _run(tmp_path, *overrides: str, name: str = "run") -> dict:
    return run_job(tmp_path, [*LOCAL, *overrides], fast=False, name=name)


# ------------------------------------------------------------------------------------ data
@pytest.mark.parametrize("suffix,body,needle", [
    (".jsonl", b'{"text": "one"}\n{"text": "tw\xff\xfeo"}\n{"text": "three"}\n',
     "line 2: not UTF-8 (byte 0xff at column 13: invalid start byte); save the file as UTF-8"),
    (".jsonl", b'{"text": "one"}\n{"text": "two"}\n{"text": "a \\ud800 b"}\n',
     "line 3: field 'text' holds a lone surrogate escape (\\ud800: half of a UTF-16 pair, not a "
     "character)"),
    (".json", b'[{"text": "one"},\n {"text": "a \\udc00"}]\n',
     "item 1: field 'text' holds a lone surrogate escape (\\udc00"),
    (".csv", b"text\none\nt\xc3wo\n", "line 3: not UTF-8 (byte 0xc3 at column 2"),
], ids=["invalid-utf8", "surrogate", "surrogate-in-a-json-array", "csv-invalid-utf8"])
def test_text_that_is_not_unicode_names_file_and_line(tmp_path, suffix, body, needle):
    path = tmp_path / f"rows{suffix}"
    path.write_bytes(body)
    s = _run(tmp_path, "data=local", f"data.path={path}")
    assert s["status"] == "invalid" and exit_code(s) == 2, s["error"]
    assert s["error"].startswith(f"{path} {needle}"), s["error"]


def test_a_held_out_file_that_is_not_utf8_is_named(tmp_path):
    """Sibling: the same check reads ``data.eval``'s file."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i} " * 8}) + "\n" for i in range(8)))
    val = tmp_path / "val.jsonl"
    val.write_bytes(b'{"text": "fine"}\n{"text": "\xc0bad"}\n')
    s = _run(tmp_path, "data=local", f"data.path={rows}", f"data.eval={val}")
    assert s["status"] == "invalid", s["error"]
    assert f"{val} line 2: not UTF-8" in s["error"]


# ----------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    s = run_job(root, [*SMOKE, "train.steps=1", "train.save_final=true"], fast=False)
    assert s["status"] == "ok", s["error"]
    return Path(s["train"]["checkpoint"])


def _damaged(checkpoint: Path, tmp_path: Path, damage) -> dict:
    copy = tmp_path / "step_000001"
    shutil.copytree(checkpoint, copy)
    damage(copy)
    return run_job(tmp_path, [*SMOKE, "train.steps=2", "train.resume_allow=[train.steps]",
                              f"train.resume_from={copy}"], fast=False)


def test_a_checkpoint_without_its_optimizer_state_names_the_file(checkpoint, tmp_path):
    s = _damaged(checkpoint, tmp_path, lambda d: (d / "optimizer.safetensors").unlink())
    assert s["status"] == "invalid", s["error"]
    assert (f"{tmp_path / 'step_000001' / 'optimizer.safetensors'} is missing: "
            "memlab_state.json refers to") in s["error"]
    assert "the optimizer state); the checkpoint is incomplete" in s["error"]
    assert "KeyError" not in s["error"] and s["memory"] is None  # refused before any load


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors",
                                  "memlab_state.safetensors"])
def test_a_truncated_checkpoint_file_names_the_file(checkpoint, tmp_path, name):
    def cut(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])

    s = _damaged(checkpoint, tmp_path, cut)
    assert s["status"] == "invalid", s["error"]
    assert (f"{tmp_path / 'step_000001' / name} is not a readable safetensors file "
            "(SafetensorError") in s["error"]
    assert "damaged (truncated?)" in s["error"]


# --------------------------------------------------------------------------- model files
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from memlab.data.assets import load_tokenizer
    from memlab.model.tiny import Tiny

    path = tmp_path_factory.mktemp("model")
    tok = load_tokenizer()
    cfg = Tiny(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
               num_kv_heads=1).hf_config(tok)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _model_run(model_dir: Path, tmp_path: Path, damage) -> dict:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    damage(copy)
    smoke = [o for o in SMOKE if not o.startswith("model.")]
    return run_job(tmp_path, [*smoke, "model=hf", f"model.name_or_path={copy}",
                              "model.local_files_only=true"], fast=False)


def test_a_model_dir_without_tokenizer_files_is_invalid(model_dir, tmp_path):
    def drop(d: Path) -> None:
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (d / f).unlink(missing_ok=True)

    s = _model_run(model_dir, tmp_path, drop)
    assert s["status"] == "invalid" and exit_code(s) == 2, s["error"]
    assert s["error"].startswith("ModelFilesError: model.name_or_path=")
    assert "has no tokenizer files" in s["error"]


@pytest.mark.parametrize("name,needle", [
    ("config.json", "config.json is not valid JSON"),
    ("model.safetensors", "model.safetensors is not a readable safetensors file"),
], ids=["config", "weights"])
def test_a_truncated_model_file_is_invalid_and_named(model_dir, tmp_path, name, needle):
    def cut(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: len(data) // 2])

    s = _model_run(model_dir, tmp_path, cut)
    assert s["status"] == "invalid" and exit_code(s) == 2, s["error"]
    assert f"{tmp_path / 'model' / name.split('.')[0]}" in s["error"] and needle in s["error"]


# -------------------------------------------------------------------------------- report
def test_report_lists_a_sweep_job_without_a_record_as_missing(tmp_path, capsys):
    """Job 1 left a dir with its log only (no summary, no .hydra/), job 2 no dir at all: both
    are ``missing``, with the overrides the sweep gave them."""
    import csv

    import yaml

    from memlab.cli.report import main as report

    sweep = tmp_path / "sweep"
    hydra = {"runtime": {"choices": {"hydra/sweeper": "basic", "peft": "none"}},
             "overrides": {"task": ["train.steps=2", "peft=none,lora,qlora"]},
             "sweeper": {"params": {"train.lr": "1e-3"}},
             "sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"}}
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": hydra}))
    (sweep / "0").mkdir()
    (sweep / "0" / "summary.json").write_text(json.dumps(
        {"status": "ok", "error": None, "choices": {"peft": "none"}, "run_dir": str(sweep / "0"),
         "overrides": ["train.lr=1e-3", "train.steps=2", "peft=none"],
         "job": {"num": 0, "sweep_dir": str(sweep)}, "memory": None, "throughput": None,
         "data": None, "train": None}))
    (sweep / "1").mkdir()
    (sweep / "1" / "memlab.log").write_text("started\n")
    assert report([str(sweep), "--out", str(tmp_path / "report"), "--no-plots"]) == 0
    assert "3 jobs: 1 ok, 2 missing" in capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "report" / "report.csv").open()))
    assert [r["status"] for r in rows] == ["ok", "missing", "missing"]
    from memlab.cli.report.load import load_summaries

    missing = load_summaries([sweep])[1:]
    by_num = {m["job"]["num"]: m for m in missing}
    assert by_num[1]["overrides"] == ["train.lr=0.001", "train.steps=2", "peft=lora"]
    assert "no summary.json and no Hydra record" in by_num[1]["error"]
    assert by_num[2]["overrides"] == ["train.lr=0.001", "train.steps=2", "peft=qlora"]
    assert by_num[2]["error"].startswith("no job dir")


def test_a_config_that_disagrees_with_its_weights_is_invalid_and_names_the_tensors(
        model_dir, tmp_path):
    """config.json edited after the weights were saved (a larger MLP): ``invalid`` naming the
    tensors whose shapes differ, not ``failed`` with transformers' "see the report above" (a
    report on the console only)."""
    import json

    def widen(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["intermediate_size"] *= 2
        (d / "config.json").write_text(json.dumps(cfg))

    s = _model_run(model_dir, tmp_path, widen)
    assert s["status"] == "invalid" and exit_code(s) == 2, s["error"]
    assert "config.json does not describe the weights saved beside it (3 tensor(s)" in s["error"]
    assert "model.layers.0.mlp.down_proj.weight: [32, 64] in the weights, [32, 128] from " \
        "config.json" in s["error"]
