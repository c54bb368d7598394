"""Pieces the preference methods (``dpo``, ``kto``, ``reward``) share.

Not an option of its own (the registry skips modules whose name starts with ``_``). Plain
functions, no base class: each method calls what it needs.

* **Rows -> tokens.** Conversational rows (``prompt`` a list of messages, completions lists of
  assistant messages): the prompt is rendered with the chat template and
  ``add_generation_prompt=True``; a completion is the suffix of the rendering of prompt +
  completion, after checking that this rendering starts with the prompt's (``DataError``
  naming the row otherwise). Plain-string rows: ``prompt`` and completion tokenized without
  special tokens, the tokenizer's EOS appended to the completion (as SFT does). Conversational
  rows without a ``prompt`` column get the longest common message prefix of chosen and rejected
  as prompt.
* **Truncation** (all limits optional): the prompt is cut from the LEFT to
  ``max_prompt_length`` (its end, next to the answer, is kept), each completion from the RIGHT to
  ``max_completion_length``, then prompt + completion to ``max_length`` by cutting the
  completion further (keep_start on the completion side: the prompt is never cut by
  ``max_length``). An example whose prompt alone fills ``max_length`` is dropped and counted.
* **Batches.** A method turns its rows into a list of sequences (``prompt + completion`` with
  labels on the completion only, shifted per sequence) and collates them either padded
  ``[S, T]`` with an attention mask, or padding-free: one ``[1, N]`` row, position_ids restarting
  at every sequence, no attention mask, and ``segment_ids`` naming each token's sequence.
* **Reference model** (``reference: copy | adapter_disabled | precomputed``): a frozen copy
  built by the pipeline's loader (its weights are checked against the policy's), the policy
  itself with its LoRA adapter disabled, or log-probs computed once before training and stored in
  the dataset as columns (the model used for that pass is freed before training starts).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from memlab.data import chat
from memlab.data.base import DataError, check_messages, check_text
from memlab.losses import segment_logps, sequence_logps
from memlab.method.base import (
    IGNORE,
    ModelFactory,
    decoder_hidden,
    flatten_batch,
    model_inputs,
    pad_batch,
    shifted_labels,
)
from memlab.trainer.routing import call_inside, unwrap

REFERENCE_MODES = ("copy", "adapter_disabled", "precomputed")
GPU_EXTRA_HINT = "needs a CUDA device and the gpu extra: pip install 'memlab[gpu]'"

# ----------------------------------------------------------------------------------- validation


def length_errors(method, names: Sequence[str]) -> list[str]:
    """Each named limit must be null or positive (>= 2 for max_length)."""
    errors = []
    for name in names:
        value = getattr(method, name)
        low = 2 if name == "max_length" else 1
        if value is not None and value < low:
            errors.append(f"method.{name} must be >= {low} or null (got {value})")
    return errors


def reference_errors(method, ctx) -> list[str]:
    if method.reference == "adapter_disabled" and not ctx.peft.has_adapter():
        return [
            f"method.reference=adapter_disabled runs the policy with its LoRA adapter switched "
            f"off, but peft={ctx.peft.name} trains no adapter; use peft=lora (or qlora), or "
            "method.reference=copy / method.reference=precomputed"
        ]
    return []


def liger_errors(method, ctx, loss_name: str) -> list[str]:
    """Checks shared by ``use_liger_kernel`` on dpo and kto."""
    if not method.use_liger_kernel:
        return []
    what = f"method.use_liger_kernel=true (Liger's fused linear {loss_name} loss)"
    errors = []
    if not ctx.is_cuda:
        errors.append(f"{what} {GPU_EXTRA_HINT}; on CPU set method.use_liger_kernel=false")
    else:
        err = ctx.platform.missing("liger_kernel", what)
        if err:
            errors.append(err)
    if method.padding_free:
        errors.append(f"{what} works on padded [batch, seq] hidden states; set "
                      "method.padding_free=false")
    if method.reference == "precomputed":
        errors.append(f"{what} computes the reference log-probs itself from the reference's "
                      "hidden states; use method.reference=copy or adapter_disabled")
    targets = getattr(ctx.peft, "target_modules", None)
    if isinstance(targets, list) and "lm_head" in targets:
        errors.append(f"{what} reads the output head's weight directly; drop lm_head from "
                      "peft.target_modules")
    return errors


# ----------------------------------------------------------------------------------- rows


def split_implicit_prompt(chosen: Any, rejected: Any, idx: int) -> tuple[list, list, list]:
    """Conversational chosen / rejected without a prompt column: the longest common message
    prefix is the prompt, the rest are the completions."""
    check_messages(chosen, idx, "chosen")
    check_messages(rejected, idx, "rejected")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise DataError(
            f"row {idx}: without a 'prompt' field, 'chosen' and 'rejected' must share a message "
            "prefix (the prompt) and differ after it; add a 'prompt' field"
        )
    return chosen[:n], chosen[n:], rejected[n:]


def encode_prompt(tok, prompt: Any, idx: int) -> list[int]:
    """Prompt tokens: the chat template with the generation prompt, or plain text."""
    if isinstance(prompt, list):
        return chat.prompt_ids(tok, prompt, idx, "prompt")
    check_text(prompt, idx, "prompt")
    return list(tok(prompt, add_special_tokens=False)["input_ids"])


def encode_completion(tok, prompt: Any, prompt_ids: list[int], completion: Any, idx: int,
                      field: str) -> list[int]:
    """Completion tokens that follow ``prompt_ids`` (see the module docstring)."""
    if isinstance(prompt, list):
        return chat.completion_ids(tok, prompt, prompt_ids, completion, idx, field)
    if isinstance(completion, list):
        raise DataError(f"row {idx}: 'prompt' is a string but '{field}' is a list of messages; "
                        "use the same format (both strings or both messages)")
    check_text(completion, idx, field)
    return list(tok(completion, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]


def encode_full(tok, prompt: Any | None, completion: Any, idx: int, field: str) -> list[int]:
    """One whole sequence (reward models): prompt + completion, or the completion alone when it
    is a full conversation / text."""
    if prompt is None:
        if isinstance(completion, list):
            return chat.conversation_ids(tok, completion, idx, field)
        check_text(completion, idx, field)
        return list(tok(completion, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    p = encode_prompt(tok, prompt, idx)
    return p + encode_completion(tok, prompt, p, completion, idx, field)


# ----------------------------------------------------------------------------------- truncation


def truncate(prompt: list[int], completions: list[list[int]], max_prompt_length: int | None,
             max_completion_length: int | None, max_length: int | None
             ) -> tuple[list[int], list[list[int]], int] | None:
    """Apply the three limits (module docstring). Returns ``(prompt, completions, dropped)``
    where ``dropped`` counts removed tokens over all ``prompt + completion`` sequences, or None
    when the prompt alone fills ``max_length`` (the example cannot be trained on)."""
    n_in = sum(len(prompt) + len(c) for c in completions)
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        prompt = prompt[len(prompt) - max_prompt_length:]
    if max_completion_length is not None:
        completions = [c[:max_completion_length] for c in completions]
    if max_length is not None:
        room = max_length - len(prompt)
        if room <= 0:
            return None
        completions = [c[:room] for c in completions]
    kept = sum(len(prompt) + len(c) for c in completions)
    return prompt, completions, n_in - kept


def is_empty(completion: Any) -> bool:
    """A completion with nothing in it: a blank string, or messages whose contents are all
    blank (its tokens are then only the EOS or the template's end-of-turn: nothing to learn)."""
    if isinstance(completion, str):
        return not completion.strip()
    if isinstance(completion, list):
        return all(isinstance(m, dict) and not str(m.get("content") or "").strip()
                   for m in completion)
    return False


def content_tokens(completion: Any, ids: list[int]) -> tuple[int, int]:
    """``(trainable tokens, 1 if empty else 0)`` of one completion and its kept token ids."""
    return (0, 1) if is_empty(completion) else (len(ids), 0)


def map_rows(ds, fn: Callable[[dict, int], list[dict]], columns: Sequence[str], key: Any,
             desc: str):
    """``fn(row, idx) -> output rows`` over the dataset (0, 1 or more rows per input row) as one
    batched ``datasets.map``; output columns ``columns``."""

    def batch_fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
        out: dict[str, list] = {c: [] for c in columns}
        for j, i in enumerate(idx):
            for row in fn({k: v[j] for k, v in batch.items()}, i):
                for c in columns:
                    out[c].append(row[c])
        return out

    fp = hashlib.sha1(repr((ds._fingerprint, key)).encode()).hexdigest()
    return ds.map(batch_fn, batched=True, batch_size=256, with_indices=True,
                  remove_columns=ds.column_names, keep_in_memory=True, new_fingerprint=fp,
                  desc=desc)


def keep_rows(ds, keep_column: str = "keep", drop: Sequence[str] = ()):
    """Rows whose ``keep`` flag is set, without the bookkeeping columns."""
    keep = ds[keep_column]
    if not all(keep):
        ds = ds.select([i for i, k in enumerate(keep) if k], keep_in_memory=True)
    return ds.remove_columns([keep_column, *drop])


# ----------------------------------------------------------------------------------- batches


def sequence(prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
    """``prompt + completion`` and its labels: shifted, on the completion tokens only."""
    ids = list(prompt) + list(completion)
    return ids, shifted_labels(ids, [0] * len(prompt) + [1] * len(completion))


def collate_sequences(seqs: list[tuple[list[int], list[int]]], pad_id: int,
                      multiple: int | None, flat: bool) -> tuple[dict[str, torch.Tensor], int, int]:
    """Padded ``[S, T]`` (attention_mask) or padding-free ``[1, N]`` (position_ids restarting per
    sequence, ``segment_ids`` = sequence index, -1 on the pad tail). Also returns
    ``last_index``: the position of each sequence's last token (reward pooling).
    Returns (tensors, real tokens, total slots)."""
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in seqs]
    if flat:
        for i, r in enumerate(rows):
            r["segment_ids"] = [i] * len(r["input_ids"])
        t, real, total = flatten_batch(rows, pad_id, multiple,
                                       {"input_ids": pad_id, "labels": IGNORE, "segment_ids": -1})
        ends = torch.tensor([len(r["input_ids"]) for r in rows]).cumsum(0) - 1
    else:
        t, real, total = pad_batch(rows, pad_id, multiple,
                                   {"input_ids": pad_id, "labels": IGNORE})
        ends = torch.tensor([len(r["input_ids"]) - 1 for r in rows])
    t["last_index"] = ends
    return t, real, total


def completion_logps(model: nn.Module, t: dict[str, torch.Tensor], n: int, prefix: str = ""
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs and scored-token counts of the ``n`` sequences in ``t``
    (padded or padding-free)."""
    logits = model(**model_inputs(t, prefix), use_cache=False).logits
    labels = t[prefix + "labels"]
    if prefix + "segment_ids" in t:
        return segment_logps(logits[0], labels[0], t[prefix + "segment_ids"][0], n)
    return sequence_logps(logits, labels)


# ----------------------------------------------------------------------------------- reference


@contextlib.contextmanager
def frozen_forward(model: nn.Module, disable_adapter: bool = False) -> Iterator[nn.Module]:
    """No grad, eval mode (no dropout), optionally the LoRA adapter off; the mode is restored."""
    inner = unwrap(model)
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            if disable_adapter:
                if not hasattr(inner, "disable_adapter"):
                    raise TypeError("reference=adapter_disabled needs a PEFT model with a LoRA "
                                    f"adapter; the policy is a {type(inner).__name__}")
                with inner.disable_adapter():
                    yield model
            else:
                yield model
    finally:
        inner.train(was_training)


def _base_name(name: str) -> str:
    """A PEFT / wrapper parameter name -> the plain model's name."""
    for prefix in ("base_model.model.",):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def override_key_errors(ctx, overrides: dict[str, Any], where: str) -> list[str]:
    """Keys of ``overrides`` (model-group overrides: a teacher, a reward model) that the run's
    model group does not have, one error each, named ``<where>.<key>``."""
    import dataclasses

    if not dataclasses.is_dataclass(ctx.model):
        return []
    fields_ = {f.name for f in dataclasses.fields(ctx.model)}
    return [f"{where}.{key}: not an option of model={ctx.model.name} (options: "
            f"{', '.join(sorted(fields_))})" for key in overrides if key not in fields_]


def overridden_model_errors(ctx, overrides: dict[str, Any], where: str) -> list[str]:
    """The model group's own validation of itself with ``overrides`` applied (keys known)."""
    import dataclasses

    if not dataclasses.is_dataclass(ctx.model):
        return []
    model = dataclasses.replace(ctx.model, **overrides)
    return [f"{where}: {e}" for e in model.validate(ctx)]


def check_same_weights(policy: nn.Module, reference: nn.Module) -> int:
    """Every reference parameter must equal the policy's (frozen base) parameter of the same
    name: a DPO / KTO reference is the policy *before* training. Returns the number compared;
    raises ValueError naming the first mismatch."""
    ours = {_base_name(n): p for n, p in unwrap(policy).named_parameters() if "lora_" not in n}
    gather = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in ours.values()):  # DeepSpeed ZeRO-3 partitions
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(ours.values()))
    with gather:
        compared = _compare_weights(ours, reference)
    if compared == 0:
        raise ValueError("could not match any reference parameter to the policy's by name")
    return compared


def _compare_weights(ours: dict[str, nn.Parameter], reference: nn.Module) -> int:
    compared = 0
    for name, ref in reference.named_parameters():
        mine = ours.get(_base_name(name))
        if mine is None or mine.shape != ref.shape or not ref.dtype.is_floating_point:
            continue
        if hasattr(mine, "full_tensor"):  # an FSDP2 shard: compare the gathered parameter
            mine = mine.detach().full_tensor()
        elif type(ref) is not nn.Parameter or type(mine) is not nn.Parameter:
            continue  # quantized storage (bitsandbytes): compared through its float neighbours
        if not torch.equal(mine.detach().to(ref.dtype), ref.detach()):
            raise ValueError(
                f"the reference copy differs from the policy at {name!r}: the model loader did "
                "not give the same initial weights twice (for model=tiny keep one seed); use "
                "method.reference=adapter_disabled (with peft=lora) or fix the loader"
            )
        compared += 1
    return compared


def reference_models(method, policy: nn.Module, ctx, build: ModelFactory
                     ) -> dict[str, nn.Module]:
    """The models a reference mode keeps next to the policy.

    copy: a frozen copy (counted as "parameters" by the memory probe during training).
    adapter_disabled: none. precomputed: a frozen copy for the one-off pass in
    :func:`precompute`, freed before training - unless the policy has a LoRA adapter, whose
    disabled state *is* the reference: then nothing is loaded at all (a second copy of the base
    would double the weights in memory during that pass, the very cost precomputing avoids).
    """
    if method.reference == "adapter_disabled":
        return {}
    if method.reference == "precomputed" and ctx.peft.has_adapter():
        return {}
    reference = build()
    if build.exact_weights:  # fake weights (an estimate) have no values to compare
        check_same_weights(policy, reference)
    return {"reference": reference}


@contextlib.contextmanager
def reference_forward(method, models: dict[str, nn.Module]) -> Iterator[nn.Module]:
    """The model to run as reference (no grad, eval mode)."""
    if "reference" in models:
        with frozen_forward(models["reference"]) as m:
            yield m
    else:
        with frozen_forward(models["policy"], disable_adapter=True) as m:
            yield m


def precompute(method, models: dict[str, nn.Module], ds, ctx,
               collate: Callable[[list[dict]], Any],
               run: Callable[[nn.Module, Any], dict[str, torch.Tensor]]):
    """Run the reference once over ``ds`` (in order, ``train.batch_size`` rows at a time) and add
    each output of ``run(model, batch)`` as a dataset column. The reference copy (if any) is
    removed from ``models`` and freed before returning."""
    import time

    t0 = time.perf_counter()
    out: dict[str, list[float]] = {}
    bs = ctx.train.batch_size
    with reference_forward(method, models) as ref:
        for start in range(0, len(ds), bs):
            cols = ds[start: start + bs]
            rows = [{k: cols[k][i] for k in cols} for i in range(len(next(iter(cols.values()))))]
            batch = collate(rows).to(ctx.device)
            with ctx.precision.autocast(ctx.device):
                values = run(ref, batch)
            for name, v in values.items():
                out.setdefault(name, []).extend(v.detach().float().cpu().tolist())
    models.pop("reference", None)
    del ref
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    fp = hashlib.sha1(repr((ds._fingerprint, "reference_logps", sorted(out))).encode())
    for i, (name, values) in enumerate(out.items()):
        ds = ds.add_column(name, values, new_fingerprint=f"{fp.hexdigest()}-{i}")
    print(f"[memlab] reference log-probs precomputed for {len(ds)} rows in "
          f"{time.perf_counter() - t0:.1f}s; no reference model is kept for training",
          flush=True)
    return ds


def pad_id_of(models: dict[str, nn.Module]) -> int:
    """The pad id the loader wrote into the model config (any value works under a mask)."""
    cfg = getattr(unwrap(models["policy"]), "config", None)
    pad = getattr(cfg, "pad_token_id", None)
    return int(pad) if pad is not None else 0


# ----------------------------------------------------------------------------------- liger


def liger_module(cls_name: str, **kwargs: Any) -> nn.Module:
    """Instantiate ``liger_kernel.chunked_loss.<cls_name>`` with the keyword arguments its
    installed version accepts (the signature grew over releases)."""
    import inspect

    import liger_kernel.chunked_loss as chunked

    cls = getattr(chunked, cls_name)
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in accepted})


def liger_loss_value(out: Any) -> torch.Tensor:
    """Liger losses return the loss or ``(loss, aux...)`` depending on the release."""
    return out[0] if isinstance(out, (tuple, list)) else out


def hidden_and_head(model: nn.Module, t: dict[str, torch.Tensor], prefix: str = ""
                    ) -> tuple[torch.Tensor, nn.Module]:
    """Final hidden states ``[S, T, H]`` (no logits) and the output head of a causal LM."""
    hidden = call_inside(model, decoder_hidden, **model_inputs(t, prefix))
    return hidden, unwrap(model).get_output_embeddings()
