"""Sharding that an estimate *models* rather than measures, stated in its assumptions.

``distributed=fsdp2`` is measured (its real wrap on fake tensors over a fake process group, see
:mod:`memlab.estimate.fake`). What cannot run on fake tensors is estimated as one plain process
whose categories are then sharded here: DDP (its C++ reducer needs real storage: one resident
gradient-sized bucket buffer is added), DeepSpeed ZeRO 0-3 (its engine: master copy, reduce
bucket, gathered parameters, see :func:`apply_sharding`), and the hypothetical ``--world-size N
--zero-stage S`` of a single-process configuration.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from memlab.estimate.options import ALL_PHASES, fmt_bytes
from memlab.trainer.routing import base_model


def deepspeed_info(ds, ctx, stage: int, model: dict[str, Any]) -> dict[str, int]:
    """What :func:`apply_sharding` adds for ``distributed=deepspeed`` (``ds``, the run's option):
    master copy, bucket, weight / gradient bytes, state factor and the live-parameter cap, from
    the model's trainable count and hidden size."""
    bf16 = ctx.precision.param_dtype == "bfloat16"
    hidden = int(model.get("config", {}).get("hidden_size") or 4096)
    elems = ds.reduce_bucket_size if ds.reduce_bucket_size is not None else hidden * hidden
    width = 2 if bf16 else 4  # bytes per weight / gradient element
    trainable = int(model["trainable"])
    return {"master_bytes": 4 * trainable if stage >= 1 else 0,
            "weight_bytes": width * trainable, "grad_bytes": width * trainable,
            "bucket_bytes": int(elems) * width if ds.contiguous_gradients and stage >= 1 else 0,
            "state_factor": 2 if bf16 else 1,
            "live_bytes": int(ds.stage3_max_live_parameters) * width}


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
                   bucket_view: bool = False,
                   deepspeed: dict[str, int] | None = None,
                   gather_generation: bool = False) -> dict[str, Any]:
    """Divide what ZeRO / FSDP shard by the world size, per phase; the peak is then the largest
    phase. Stage 3 adds the gathered parameters of the two largest units in forward and backward
    (the current one and the prefetched next); stages 2-3 add one unit of unsharded gradients in
    backward (before its reduce-scatter). Stage 0 with world > 1 is DDP: its gradient buckets
    (allocated when the model is wrapped, resident for the whole run) add one gradient-sized
    buffer; with ``bucket_view`` (``gradient_as_bucket_view=True``) the gradients live inside
    them instead, so gradient memory is the full gradient size in every phase.

    ``deepspeed`` (``distributed=deepspeed``: ``master_bytes``, ``bucket_bytes``,
    ``state_factor``): stages >= 1 add DeepSpeed's fp32 master copy of the rank's slice of the
    trainable weights to the optimizer state and multiply the state by ``state_factor`` (2 when
    bf16 weights get fp32 moments); backward holds its contiguous reduce bucket; stage 0 is
    DeepSpeed's own all-reduce at the boundary, without DDP's resident buckets.

    ``gather_generation`` (stage 3, ``gather_for_generation``): the generate phase holds the
    whole weights gathered beside the rank's shards."""
    notes = notes if notes is not None else []
    if world <= 1 and deepspeed is None:
        return mem
    units = units or {}
    unit_p, unit_g = units.get("largest_bytes", 0), units.get("largest_grad_bytes", 0)
    div = {"optimizer": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
    phases = {}
    for ph, snap in (mem.get("by_phase_category") or {}).items():
        new = {k: (math.ceil(v / world) if div.get(k) else v) for k, v in snap.items()}
        if deepspeed is not None:
            if stage >= 3 and ph in ("forward", "backward"):
                # gathered: at least two units in flight, at most stage3_max_live_parameters
                # (all of a model below it: measured, whatever stage3_max_reuse_distance)
                full = snap.get("parameters", 0)
                new["parameters"] += min(full, max(2 * unit_p, deepspeed["live_bytes"]))
            elif stage >= 3 and ph == "generate":  # no backward to reuse them for
                new["parameters"] += min(snap.get("parameters", 0), 2 * unit_p)
            if stage >= 1:
                master = math.ceil(deepspeed["master_bytes"] / world)
                new["optimizer"] = new.get("optimizer", 0) * deepspeed["state_factor"] + master
                if ph == "backward":
                    new["gradients"] += deepspeed["bucket_bytes"]
                if ph == "optimizer":  # the step's fp32 gradient slice, then the all-gather
                    new["optimizer"] += master  # of the updated weights
                    new["activations"] += math.ceil(deepspeed["weight_bytes"] / world)
            if stage >= 3:  # one flat gradient partition, allocated once, resident
                new["gradients"] = max(new["gradients"],
                                       math.ceil(deepspeed["grad_bytes"] / world))
        else:
            if stage == 0:
                full = (mem.get("by_phase_category") or {}).get("optimizer", {}).get(
                    "gradients", 0)
                g = snap.get("gradients", 0)
                new["gradients"] = max(g, full) if bucket_view else g + full
            if stage >= 3 and ph in ("generate", "forward", "backward"):
                new["parameters"] += 2 * unit_p
            if stage >= 2 and ph == "backward":
                new["gradients"] += unit_g
        if stage >= 3 and ph == "generate" and gather_generation:
            full = snap.get("parameters", 0)
            new["parameters"] = math.ceil(full / world) + full
        phases[ph] = new
    if deepspeed is not None:
        notes.append(f"world_size={world}, distributed=deepspeed zero_stage={stage}: "
                     + ("nothing sharded" if stage == 0 else
                        f"{', '.join(k for k in ('optimizer', 'gradients', 'parameters') if div[k])}"
                        f" divided by {world} per rank, plus DeepSpeed's fp32 master copy of the "
                        f"rank's slice ({fmt_bytes(math.ceil(deepspeed['master_bytes'] / world))})"
                        f" in optimizer (and an fp32 gradient slice of that size in the "
                        f"step), its reduce bucket ({fmt_bytes(deepspeed['bucket_bytes'])}) in "
                        f"backward, the all-gather of the updated slice after the step"
                        + ("; stage 3 keeps up to stage3_max_live_parameters gathered in "
                           "forward/backward (at least two units, at most all of them) and one "
                           "flat gradient partition for the whole run"
                           if stage >= 3 else ""))
                     + "; other communication buffers are not modelled")
    elif stage == 0:
        notes.append(f"world_size={world}, zero_stage=0 (DDP): nothing sharded; DDP's gradient "
                     "buckets hold one gradient-sized buffer for the whole run ("
                     + ("gradient_as_bucket_view=True: the gradients live in it)" if bucket_view
                        else "gradient_as_bucket_view=False: beside the gradients)"))
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
    peak_phase = max(by_phase, key=by_phase.get) if by_phase else None
    out = dict(mem)
    out["by_phase_category"] = phases
    out["by_phase"] = {ph: int(by_phase[ph]) for ph in ALL_PHASES if ph in by_phase}
    out["by_category"] = dict(phases[peak_phase]) if peak_phase else mem["by_category"]
    out["peak_bytes"] = int(by_phase[peak_phase]) if peak_phase else mem["peak_bytes"]
    out["peak_at"] = {"step": (mem.get("peak_at") or {}).get("step"), "phase": peak_phase}
    return out
