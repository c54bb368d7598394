"""The real loading paths users run (hub models and datasets), exercised with local files:
model=hf from a saved directory, data=hub from a local dataset folder, data=local jsonl and
parquet."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def _rows(n=12):
    from memlab.data.synthetic import generate_chat

    return generate_chat(n, seed=3, median_tokens=60, max_tokens=200)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from memlab.data.assets import load_tokenizer
    from memlab.model.tiny import Tiny

    path = tmp_path_factory.mktemp("hf_model")
    tok = load_tokenizer()
    cfg = Tiny(hidden_size=64, intermediate_size=128, num_layers=2).hf_config(tok)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_hf_model_from_local_directory(job, saved_model):
    s = job(["model=hf", f"model.name_or_path={saved_model}", "model.local_files_only=true"])
    assert s["status"] == "ok", s["error"]
    assert s["memory"]["params"]["total"] > 0


def test_hf_model_missing_path_fails_clearly(job, tmp_path):
    s = job(["model=hf", f"model.name_or_path={tmp_path / 'nope'}", "model.local_files_only=true"])
    assert s["status"] == "invalid" and "nope: no such directory" in s["error"]


def test_hub_dataset_from_local_folder(job, tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in _rows()))
    s = job(["data=hub", f"data.path={folder}", "data.split=train", "data.max_examples=10"])
    assert s["status"] == "ok", s["error"]
    assert s["data"]["examples"] == 10


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_local_files(job, tmp_path, fmt):
    import datasets

    ds = datasets.Dataset.from_list(_rows())
    path = tmp_path / f"train.{fmt}"
    if fmt == "jsonl":
        ds.to_json(path)
    else:
        ds.to_parquet(path)
    s = job(["data=local", f"data.path={path}"])
    assert s["status"] == "ok", s["error"]
    assert s["data"]["examples"] == 12


def test_plain_text_and_prompt_completion_rows(job, tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"row {i} " * 20}) for i in range(8)))
    s = job(["data=local", f"data.path={text}"])
    assert s["status"] == "ok", s["error"]
    pc = tmp_path / "pc.jsonl"
    pc.write_text("\n".join(json.dumps({"prompt": f"question {i}?", "completion": " answer " * 5})
                            for i in range(8)))
    s = job(["data=local", f"data.path={pc}"])
    assert s["status"] == "ok", s["error"]
