"""The frozen reference of the methods that regularise towards the initial policy (``dpo``,
``kto``, and the online methods with ``beta > 0``), and the frozen forwards of other extra
models (a teacher, a value model during generation).

Not an option of its own. ``reference: copy | adapter_disabled | precomputed``: a frozen copy
built by the pipeline's loader (its weights are checked against the policy's), the policy itself
with its LoRA adapter disabled, or log-probs computed once before training and stored in the
dataset as columns (the model used for that pass is freed before training starts).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from memlab.measure import runlog
from memlab.method.base import ModelFactory
from memlab.trainer.routing import unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.distributed.base import Distributed

REFERENCE_MODES = ("copy", "adapter_disabled", "precomputed")


class WithReference(Protocol):
    """A method that regularises towards the frozen initial policy: its ``reference`` mode."""

    @property
    def reference(self) -> str: ...


def reference_errors(method: WithReference, ctx: BuildContext) -> list[str]:
    """``reference=adapter_disabled`` needs an adapter to disable (the peft option declares one)."""
    if method.reference == "adapter_disabled" and not ctx.peft.has_adapter():
        return [
            f"method.reference=adapter_disabled runs the policy with its LoRA adapter switched "
            f"off, but peft={ctx.peft.name} trains no adapter; use peft=lora (or qlora), or "
            "method.reference=copy / method.reference=precomputed"
        ]
    return []


@contextlib.contextmanager
def frozen_forward(model: nn.Module, disable_adapter: bool = False) -> Iterator[nn.Module]:
    """No grad, eval mode (no dropout), optionally the LoRA adapter off; the mode is restored."""
    inner = unwrap(model)
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            if disable_adapter:
                from peft import PeftModel  # only here: a run without an adapter skips peft

                if not isinstance(inner, PeftModel):
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


def check_same_weights(policy: nn.Module, reference: nn.Module, distributed: Distributed
                       ) -> int:
    """Every reference parameter must equal the policy's (frozen base) parameter of the same
    name: a DPO / KTO reference is the policy *before* training. ``distributed`` (the run's
    option) gathers a parameter its wrapper shards (a collective: every rank compares). Returns
    the number compared; raises ValueError naming the first mismatch."""
    ours = {_base_name(n): p for n, p in unwrap(policy).named_parameters() if "lora_" not in n}
    compared = 0
    for name, ref in reference.named_parameters():
        mine = ours.get(_base_name(name))
        if mine is None or not ref.dtype.is_floating_point:
            continue
        with distributed.gathered(mine) as whole:
            if whole.shape != ref.shape or not whole.dtype.is_floating_point:
                continue  # quantized storage (bitsandbytes): compared through its neighbours
            if not torch.equal(whole.detach().to(ref.dtype), ref.detach()):
                raise ValueError(
                    f"the reference copy differs from the policy at {name!r}: the model loader "
                    "did not give the same initial weights twice (for model=tiny keep one "
                    "seed); use method.reference=adapter_disabled (with peft=lora) or fix the "
                    "loader")
        compared += 1
    if compared == 0:
        raise ValueError("could not match any reference parameter to the policy's by name")
    return compared


def reference_models(method: WithReference, policy: nn.Module, ctx: BuildContext,
                     build: ModelFactory) -> dict[str, nn.Module]:
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
        check_same_weights(policy, reference, ctx.distributed)
    return {"reference": reference}


@contextlib.contextmanager
def reference_forward(method: WithReference, models: dict[str, nn.Module]) -> Iterator[nn.Module]:
    """The model to run as reference (no grad, eval mode)."""
    if "reference" in models:
        with frozen_forward(models["reference"]) as m:
            yield m
    else:
        with frozen_forward(models["policy"], disable_adapter=True) as m:
            yield m


def precompute(method: WithReference, models: dict[str, nn.Module], ds, ctx: BuildContext,
               collate: Callable[[list[dict]], Any],
               run: Callable[[nn.Module, Any, list[dict]], dict[str, list]]):
    """Run the reference once over ``ds`` (in order, ``train.batch_size`` rows at a time, or
    one packed micro-batch at a time) and add each output of ``run(model, batch, items)`` (one
    value per dataset item) as a dataset column. The reference copy (if any) is removed from
    ``models`` and freed before returning."""
    import time

    from memlab.packing.groups import PACK_ROWS

    t0 = time.perf_counter()
    out: dict[str, list] = {}
    bs = 1 if PACK_ROWS in ds.column_names else ctx.train.batch_size
    with reference_forward(method, models) as ref:
        for start in range(0, len(ds), bs):
            cols = ds[start: start + bs]
            rows = [{k: cols[k][i] for k in cols} for i in range(len(next(iter(cols.values()))))]
            batch = collate(rows).to(ctx.device)
            with ctx.precision.autocast(ctx.device):
                values = run(ref, batch, rows)
            for name, v in values.items():
                out.setdefault(name, []).extend(v)
    models.pop("reference", None)
    del ref
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    fp = hashlib.sha1(repr((ds._fingerprint, "reference_logps", sorted(out))).encode())
    for i, (name, column) in enumerate(out.items()):
        ds = ds.add_column(name, column, new_fingerprint=f"{fp.hexdigest()}-{i}")
    runlog.say(f"[memlab] reference log-probs precomputed for {len(ds)} rows in "
               f"{time.perf_counter() - t0:.1f}s; no reference model is kept for training")
    return ds
