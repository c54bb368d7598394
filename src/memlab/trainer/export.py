"""The Hugging Face directory inside every checkpoint: what a researcher keeps from a run.

- Full fine-tuning: the model as ``save_pretrained`` writes it (``config.json``,
  ``model.safetensors`` or shards + index, ``generation_config.json``) and the tokenizer; it
  loads with ``AutoModelForCausalLM.from_pretrained(dir)`` (a reward model:
  ``AutoModelForSequenceClassification``).
- PEFT (LoRA / QLoRA): the adapter (``adapter_config.json``, ``adapter_model.safetensors``) and
  the tokenizer; it loads with ``PeftModel.from_pretrained(base, dir)``. With
  ``train.save_merged`` also ``dir/merged``: the base with the adapter merged into it, a plain
  model directory. The base is loaded again for that, unquantized, on the host (QLoRA's adapter is
  merged into the full-precision base, as it should be; the training model is not touched).

Distributed runs pass the gathered weights (``weights``: FSDP2's, DeepSpeed's ZeRO-3) and write
from rank 0 only. The saved ``config.json`` has ``use_cache: true`` (memlab turns the KV cache off
for training; a model loaded for inference wants it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memlab.trainer.routing import HFModel, base_model

if TYPE_CHECKING:
    from memlab.context import BuildContext

MERGED = "merged"
"""Subdirectory of a checkpoint that holds the merged model (``train.save_merged``)."""


def _inference_config(out: Path) -> None:
    """``use_cache: true`` in the saved config (training runs without the KV cache)."""
    path = out / "config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if cfg.get("use_cache") is False:
            cfg["use_cache"] = True
            path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write(ctx: BuildContext, model: HFModel, weights: dict[str, torch.Tensor] | None,
          out: Path) -> dict:
    """Write the Hugging Face directory of the policy ``model`` (unwrapped: a transformers model
    or a PeftModel) into ``out``; ``weights`` replaces the model's own tensors when they are
    sharded (gathered, named as in ``model``). Returns what was written (``kind``, ``head``,
    ``architecture``, ``merged``)."""
    adapter = ctx.peft.has_adapter()
    kw: dict[str, Any] = {}
    if weights is not None:  # save_pretrained pops what it writes: give it its own dict
        kw["state_dict"] = dict(weights)
    with torch.random.fork_rng(devices=[]):  # saving must not move the run's random stream
        model.save_pretrained(str(out), **kw)
        _inference_config(out)
        tokenizer = ctx.model.load_tokenizer(ctx)
        tokenizer.save_pretrained(out)
        merged = None
        if adapter and ctx.train.save_merged:
            merged = write_merged(ctx, tokenizer, out, out / MERGED)
    return {"kind": "adapter" if adapter else "model", "head": ctx.method.head,
            "architecture": type(base_model(model)).__name__,
            "merged": MERGED if merged else None}


def write_merged(ctx: BuildContext, tokenizer, adapter_dir: Path, out: Path) -> Path:
    """Load the base model again on the host (the model option's ``load``, unquantized, sdpa
    attention), apply the adapter saved in ``adapter_dir``, merge it, and save the result to
    ``out`` with the tokenizer."""
    from peft import PeftModel

    host = dataclasses.replace(ctx, device="cpu")
    base = ctx.model.load(host, tokenizer, ctx.method.head, {"attn_implementation": "sdpa"})
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out)
    _inference_config(out)
    tokenizer.save_pretrained(out)
    del base, merged
    return out


def weight_names(out: Path) -> set[str]:
    """Names of the tensors in a saved model directory's weight files (none for an adapter)."""
    from safetensors import safe_open

    index = out / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = out / "model.safetensors"
    if not single.is_file():
        return set()
    with safe_open(str(single), framework="pt") as f:
        return set(f.keys())


def read_model_weights(out: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """Tensors ``names`` from a saved model directory's weight files."""
    from safetensors import safe_open

    index = out / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for n in names:
            files.setdefault(where[n], []).append(n)
    else:
        files = {"model.safetensors": sorted(names)}
    found: dict[str, torch.Tensor] = {}
    for file, keys in files.items():
        with safe_open(str(out / file), framework="pt") as f:
            for k in keys:
                found[k] = f.get_tensor(k)
    return found
