"""model=hf (and model=tiny's tokenizer dir): clear, early errors for every way loading can
fail, from local directories made here and a hub that cannot be reached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memlab.model._files import ModelFilesError
from memlab.model.hf import HubModel
from memlab.model.tiny import Tiny
from memlab_testing import FAST, REPO

HF_FAST = [o for o in FAST if not o.startswith("model.")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved with save_pretrained, its tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    from memlab.data.assets import load_tokenizer

    path = tmp_path_factory.mktemp("saved")
    tok = load_tokenizer()
    cfg = Tiny(hidden_size=64, intermediate_size=128, num_layers=2).hf_config(tok)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _ctx(overrides):
    from omegaconf import OmegaConf

    from memlab.context import validate
    from memlab_testing import compose

    cfg = OmegaConf.to_container(compose(HF_FAST + ["model=hf", *overrides]))
    del cfg["hydra"]
    return validate(OmegaConf.create(cfg))


def _copy(src: Path, dst: Path, keep) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if keep(f.name):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_saved_directory_loads_and_matches_the_saved_weights(saved):
    import torch
    from transformers import AutoModelForCausalLM

    ctx = _ctx([f"model.name_or_path={saved}"])
    tok = ctx.model.load_tokenizer(ctx)
    model = ctx.model.load(ctx, tok, "causal_lm", {})
    ref = AutoModelForCausalLM.from_pretrained(saved)
    ids = torch.tensor([tok("the sauce is golden")["input_ids"]])
    assert torch.equal(model(ids).logits, ref(ids).logits)


def test_missing_directory_is_a_config_error_naming_the_path(tmp_path, monkeypatch):
    from memlab.registry import ConfigErrors

    missing = tmp_path / "models" / "qwen-sft"
    errors = HubModel(name_or_path=str(missing)).validate(None)
    assert len(errors) == 1
    assert "no such directory" in errors[0] and str(missing) in errors[0]
    assert f"nearest existing parent is {tmp_path}" in errors[0]
    # a relative path whose first component exists is a path, not a hub id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    errors = HubModel(name_or_path="models/qwen-sft").validate(None)
    assert errors and "no such directory" in errors[0]
    # a hub id is not checked here (no network in validate); an empty name is refused
    assert HubModel(name_or_path="Qwen/Qwen2.5-0.5B").validate(None) == []
    assert "must name a hub model or a local directory" in HubModel(
        name_or_path="").validate(None)[0]
    # all problems at once, before anything loads
    with pytest.raises(ConfigErrors) as e:
        _ctx([f"model.name_or_path={missing}", f"model.tokenizer={tmp_path / 'tok'}",
              f"model.chat_template={tmp_path / 't.jinja'}"])
    text = str(e.value)
    assert "model.name_or_path" in text and "model.tokenizer" in text
    assert "model.chat_template" in text


def test_directory_without_config_weights_or_tokenizer_names_what_is_missing(saved, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (err,) = HubModel(name_or_path=str(empty)).validate(None)
    assert "has no config.json" in err and "save_pretrained" in err

    no_weights = _copy(saved, tmp_path / "no_weights", lambda n: not n.endswith(".safetensors"))
    ctx = _ctx([f"model.name_or_path={no_weights}"])  # config.json is there: valid
    tok = ctx.model.load_tokenizer(ctx)
    with pytest.raises(ModelFilesError, match="has no weight files.*model.safetensors"):
        ctx.model.load(ctx, tok, "causal_lm", {})

    no_tok = _copy(saved, tmp_path / "no_tok", lambda n: not n.startswith(("tokenizer",
                                                                            "special")))
    ctx = _ctx([f"model.name_or_path={no_tok}"])
    with pytest.raises(ModelFilesError, match=r"has no tokenizer files \(tokenizer.json"):
        ctx.model.load_tokenizer(ctx)
    # ... which model.tokenizer fixes
    ctx = _ctx([f"model.name_or_path={no_tok}", f"model.tokenizer={saved}"])
    assert ctx.model.load_tokenizer(ctx).chat_template


def test_tiny_tokenizer_dir_and_chat_template_file(saved, tmp_path):
    assert "no such directory" in Tiny(tokenizer=str(tmp_path / "nope")).validate(None)[0]
    assert "has no tokenizer files" in Tiny(tokenizer=str(tmp_path)).validate(None)[0]
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    (err,) = Tiny(chat_template=str(tmp_path / "broken.jinja")).validate(None)
    assert "not a valid Jinja template" in err
    template = ("{%- for m in messages -%}{{- m['role'] + ': ' -}}{%- generation -%}"
                "{{- m['content'] + '<|im_end|>' -}}{%- endgeneration -%}{%- endfor -%}")
    (tmp_path / "t.jinja").write_text(template)
    tiny = Tiny(tokenizer=str(saved), chat_template=str(tmp_path / "t.jinja"))
    assert tiny.validate(None) == []
    assert tiny.load_tokenizer(None).chat_template == template
    hub = HubModel(name_or_path=str(saved), chat_template=str(tmp_path / "t.jinja"))
    assert hub.load_tokenizer(None).chat_template == template


def test_offline_hub_name_not_in_the_cache_fails_at_once():
    t0 = time.perf_counter()
    with pytest.raises(ModelFilesError) as e:
        HubModel(name_or_path="someorg/no-such-model", local_files_only=True).load_tokenizer(None)
    assert time.perf_counter() - t0 < 1.0
    assert "model.local_files_only=true forbids downloading" in str(e.value)
    assert "hf download someorg/no-such-model" in str(e.value)
    # HF_HUB_OFFLINE=1 (set for every test) is honoured the same way
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    with pytest.raises(ModelFilesError, match="HF_HUB_OFFLINE=1 forbids downloading"):
        HubModel(name_or_path="someorg/no-such-model").load(None, None, "causal_lm", {})


# ------------------------------------------------------------------------------ unreachable hub

PROBE = textwrap.dedent("""
    import json, sys, time
    from transformers import AutoTokenizer
    from memlab.model.hf import HubModel
    AutoTokenizer.from_pretrained(sys.argv[2])  # imports (seconds here) are not what is timed
    t0 = time.perf_counter()
    try:
        tok = HubModel(name_or_path=sys.argv[1]).load_tokenizer(None)
        out = {"ok": True, "vocab": len(tok)}
    except Exception as e:
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out))
""")


def _unreachable(name: str, hf_home: Path, local: Path) -> dict:
    """Load ``name``'s tokenizer in a fresh process whose hub endpoint refuses connections
    (HF_HUB_OFFLINE unset: the network is closed, not switched off)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(hf_home),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", PROBE, name, str(local)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_unreachable_hub_fails_within_seconds_and_names_the_fix(saved, tmp_path):
    res = _unreachable("someorg/no-such-model", tmp_path, saved)
    assert not res["ok"]
    assert res["seconds"] < 5, res  # huggingface_hub alone retries for ~50 s
    assert "cannot be reached" in res["error"] and "not in the local cache" in res["error"]
    assert "hf download someorg/no-such-model --local-dir DIR" in res["error"]


@pytest.mark.slow
def test_unreachable_hub_loads_a_cached_copy_offline(saved, tmp_path):
    """A model already in the HF cache loads without waiting for the hub."""
    snapshot = tmp_path / "hub" / "models--someorg--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in saved.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    refs = snapshot.parents[1] / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    res = _unreachable("someorg/cached", tmp_path, saved)
    assert res["ok"], res
    assert res["seconds"] < 5, res
