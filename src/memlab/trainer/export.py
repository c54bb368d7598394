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
  A base the adapter cannot name (one built from a config, as ``model=tiny`` is: PEFT records
  ``base_model_name_or_path: null``) is saved once in the run dir, ``<run dir>/base/`` (model and
  tokenizer), and the adapter's ``adapter_config.json`` names it (its absolute path): the adapter
  then loads on its own, ``AutoPeftModelForCausalLM.from_pretrained(dir)``, or with
  ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("<run dir>/base"), dir)``
  once the run dir has moved.

Distributed runs pass the gathered weights (``weights``: FSDP2's, DeepSpeed's ZeRO-3) and write
from rank 0 only. The saved ``config.json`` has ``use_cache: true`` (memlab turns the KV cache off
for training; a model loaded for inference wants it).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memlab.trainer.routing import HFModel, base_model

if TYPE_CHECKING:
    from memlab.context import BuildContext

MERGED = "merged"
"""Subdirectory of a checkpoint that holds the merged model (``train.save_merged``)."""
BASE = "base"
"""Subdirectory of the run dir that holds the base of an adapter that cannot name its own."""


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
        merged = base = None
        if adapter:
            base = write_base(ctx, tokenizer, out)
        if adapter and ctx.train.save_merged:
            merged = write_merged(ctx, tokenizer, out, out / MERGED)
    return {"kind": "adapter" if adapter else "model", "head": ctx.method.head,
            "architecture": type(base_model(model)).__name__,
            "merged": MERGED if merged else None, "base": base}


def _load_base(ctx: BuildContext, tokenizer) -> Any:
    """The base model loaded again on the host (the model option's ``load``, unquantized, sdpa
    attention): the weights the adapter was trained on."""
    host = dataclasses.replace(ctx, device="cpu")
    return ctx.model.load(host, tokenizer, ctx.method.head, {"attn_implementation": "sdpa"})


def write_base(ctx: BuildContext, tokenizer, adapter_dir: Path) -> str | None:
    """Where the adapter in ``adapter_dir`` finds its base: None when its
    ``adapter_config.json`` names one already (a hub id, a local model); else the base saved to
    ``<run dir>/base`` (replaced whole, never half-written) and named there by its absolute
    path."""
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    if config.get("base_model_name_or_path"):
        return None
    where = Path(ctx.run_dir).resolve() / BASE
    tmp = where.with_name(f".{BASE}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    base = _load_base(ctx, tokenizer)
    base.save_pretrained(tmp)
    _inference_config(tmp)
    tokenizer.save_pretrained(tmp)
    del base
    shutil.rmtree(where, ignore_errors=True)
    tmp.rename(where)
    config["base_model_name_or_path"] = str(where)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return str(where)


def write_merged(ctx: BuildContext, tokenizer, adapter_dir: Path, out: Path) -> Path:
    """Load the base model again on the host (the model option's ``load``, unquantized, sdpa
    attention), apply the adapter saved in ``adapter_dir``, merge it, and save the result to
    ``out`` with the tokenizer."""
    from peft import PeftModel

    base = _load_base(ctx, tokenizer)
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
