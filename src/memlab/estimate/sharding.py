"""Sharding that an estimate *models* rather than measures, stated in its assumptions.

``distributed=fsdp2`` and ``distributed=deepspeed`` (ZeRO 0-3) are measured: their real wrap on
fake tensors as rank 0 of torch's fake process group (:mod:`memlab.estimate.fake`). What cannot
run there is estimated as one plain process whose categories are then sharded here:

- ``distributed=ddp``: its C++ reducer reads tensor data, which fake tensors have none of
  (``DistributedDataParallel.__init__`` verifies the parameters' shapes across ranks through a
  metadata tensor, and the second iteration rebuilds the gradient buckets the same way: "The
  tensor has a non-zero number of elements, but its data is not allocated yet"; built outside
  the fake mode instead, its real buckets receive fake gradients, which the fake mode refuses).
  Its model adds one resident gradient-sized bucket buffer; its error against a real 2-rank
  run is :data:`DDP_MODEL_ERROR` (asserted in ``tests/integration/test_distributed.py``);
- the hypothetical ``--world-size N --zero-stage S`` of a single-process configuration.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from memlab.estimate.options import ALL_PHASES, fmt_bytes
from memlab.trainer.routing import base_model

DDP_MODEL_ERROR = 0.0
"""The DDP model's peak against a real 2-rank CPU run (gloo) of the agreement case in
``tests/integration/test_distributed.py``, as a fraction of the real peak: equal to the byte
(the run's tracker books DDP's rebuilt buckets as activations, the model as gradients)."""


def shard_units(model: nn.Module) -> dict[str, int]:
    """FSDP / ZeRO-3 wrapping units: each decoder layer (the model's ``_no_split_modules``) and
    the rest (embeddings, head, final norm) as the root unit. Returns the largest unit's
    parameter bytes and trainable (gradient) bytes."""
    names = set(getattr(base_model(model), "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]

    def nbytes(params, trainable_only=False):
        seen, total = set(), 0
        for p in params:
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            total += p.numel() * p.element_size()
        return total

    sizes = [(nbytes(m.parameters()), nbytes(m.parameters(), True)) for m in layers]
    in_layers = {id(p) for m in layers for p in m.parameters()}
    rest = [p for p in model.parameters() if id(p) not in in_layers]
    sizes.append((nbytes(rest), nbytes(rest, True)))
    return {"units": len(sizes), "largest_bytes": max(s[0] for s in sizes),
            "largest_grad_bytes": max(s[1] for s in sizes)}


def apply_sharding(mem: dict[str, Any], world: int, stage: int,
                   units: dict[str, int] | None = None,
                   notes: list[str] | None = None,
                   bucket_view: bool = False) -> dict[str, Any]:
    """Divide what ZeRO / FSDP shard by the world size, per phase; the peak is then the largest
    phase. Stage 3 adds the gathered parameters of the two largest units in forward and backward
    (the current one and the prefetched next); stages 2-3 add one unit of unsharded gradients in
    backward (before its reduce-scatter). Stage 0 with world > 1 is DDP: its gradient buckets
    (allocated when the model is wrapped, resident for the whole run) add one gradient-sized
    buffer; with ``bucket_view`` (``gradient_as_bucket_view=True``) the gradients live inside
    them instead, so gradient memory is the full gradient size in every phase."""
    notes = notes if notes is not None else []
    if world <= 1:
        return mem
    units = units or {}
    unit_p, unit_g = units.get("largest_bytes", 0), units.get("largest_grad_bytes", 0)
    div = {"optimizer": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
    phases = {}
    for ph, snap in (mem.get("by_phase_category") or {}).items():
        new = {k: (math.ceil(v / world) if div.get(k) else v) for k, v in snap.items()}
        if stage == 0:
            full = (mem.get("by_phase_category") or {}).get("optimizer", {}).get("gradients", 0)
            g = snap.get("gradients", 0)
            new["gradients"] = max(g, full) if bucket_view else g + full
        if stage >= 3 and ph in ("generate", "forward", "backward"):
            new["parameters"] += 2 * unit_p
        if stage >= 2 and ph == "backward":
            new["gradients"] += unit_g
        phases[ph] = new
    if stage == 0:
        notes.append(f"world_size={world}, zero_stage=0 (DDP): nothing sharded; DDP's gradient "
                     "buckets hold one gradient-sized buffer for the whole run ("
                     + ("gradient_as_bucket_view=True: the gradients live in it)" if bucket_view
                        else "gradient_as_bucket_view=False: beside the gradients)")
                     + f"; this model's measured error: {100 * DDP_MODEL_ERROR:+.2f}% of a "
                       "real 2-rank CPU run's peak (gloo, the agreement case of "
                       "tests/integration/test_distributed.py)")
    else:
        what = [k for k in ("optimizer", "gradients", "parameters") if div[k]]
        extra = []
        if stage >= 3:
            extra.append(f"forward/backward gather two units' parameters (2 x "
                         f"{fmt_bytes(unit_p)}; units = decoder layers + the root)")
        if stage >= 2:
            extra.append(f"backward holds one unit's unsharded gradients "
                         f"({fmt_bytes(unit_g)}) before its reduce-scatter")
        notes.append(f"world_size={world}, zero_stage={stage}"
                     + (" (FSDP full shard)" if stage == 3 else "")
                     + f": {', '.join(what)} divided by {world} per rank; "
                     + "; ".join(extra) + ("; " if extra else "")
                     + "activations are per rank (each rank runs its own micro-batch); other "
                       "communication buffers are not modelled")
    by_phase = {ph: sum(s.values()) for ph, s in phases.items()}
    peak_phase = max(by_phase, key=by_phase.__getitem__) if by_phase else None
    out = dict(mem)
    out["by_phase_category"] = phases
    out["by_phase"] = {ph: int(by_phase[ph]) for ph in ALL_PHASES if ph in by_phase}
    out["by_category"] = dict(phases[peak_phase]) if peak_phase else mem["by_category"]
    out["peak_bytes"] = int(by_phase[peak_phase]) if peak_phase else mem["peak_bytes"]
    out["peak_at"] = {"step": (mem.get("peak_at") or {}).get("step"), "phase": peak_phase}
    return out
