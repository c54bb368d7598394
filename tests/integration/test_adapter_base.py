"""A LoRA adapter trained on a base that has no name to load it by (``model=tiny``, built from a
config) loads on its own: the base is saved once in the run dir (``base/``), the adapter's
``adapter_config.json`` names it, and PEFT's own loaders give the logits of the run's merged
model (memlab.trainer.export)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memlab_testing import run_job

pytestmark = pytest.mark.integration


def _logits(model) -> torch.Tensor:
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_a_tiny_models_adapter_loads_with_its_base(tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = run_job(tmp_path, ["peft=lora", "train.steps=2", "train.lr=1e-2",
                                 "train.save_final=true", "train.save_merged=true",
                                 "measure.memory_steps=0"])
    assert summary["status"] == "ok", summary["error"]
    run_dir = Path(summary["run_dir"])
    ckpt = run_dir / "checkpoints" / "step_000002"
    base_dir = run_dir / "base"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    state = json.loads((ckpt / "memlab_state.json").read_text())
    assert state["export"]["base"] == str(base_dir.resolve())
    assert not (ckpt / "model.safetensors").exists()  # the base is not in every checkpoint
    assert AutoTokenizer.from_pretrained(base_dir).get_vocab() == \
        AutoTokenizer.from_pretrained(ckpt).get_vocab()

    merged = _logits(AutoModelForCausalLM.from_pretrained(ckpt / "merged"))
    alone = AutoPeftModelForCausalLM.from_pretrained(ckpt)  # finds its base by itself
    torch.testing.assert_close(_logits(alone), merged, rtol=1e-4, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    before = _logits(base)
    pair = PeftModel.from_pretrained(base, ckpt)  # the pair, wherever the run dir went
    torch.testing.assert_close(_logits(pair), merged, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, merged, atol=1e-4)  # the adapter changes the base
