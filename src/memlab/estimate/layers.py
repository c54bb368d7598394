"""Deep models estimated from two shallow ones, exactly.

A decoder's layers are identical: every training step (and every generate call) runs the same
ops in each, on tensors of the same shapes. So the memory at any moment inside the ``i``-th
layer's work, in a model of ``L`` layers, is ``A + B*L + C*i``: ``A`` what that moment of one
layer allocates (and the embedding, head and loss around them hold), ``B`` what each layer adds
everywhere (its weights, gradients, optimizer state), ``C`` what each layer before it left
behind (saved activations in forward; gradients in backward; a KV cache while generating). The
largest over the layers is therefore at one of the two ends, and every moment outside the
middle layers grows by a fixed number of bytes per layer. The estimate measures the model at
:data:`MEASURED` depths (3 and 4 layers: each has a first two and a last two, and at 4 they
are four different layers), the tracker recording the memory after every op and labelling
each stretch of time ("visit") by the part of the model running
(:func:`memlab.estimate.modes.estimate_tracker`'s phase log; the labels come from hooks on
the layers: forward, the work after a layer's forward, the backward from the gradient of its
output; and on each layer of a KV cache grown or repeated outside them). It then extends
every moment, the parameter counts and the FLOPs along their line to the model's depth
(:func:`_phase`) and replays the phases through the run's own
:class:`~memlab.measure.memory.MemoryProbe`: the largest moment of each phase is its peak. A
24-layer model costs the estimate 7 layers instead of 24.

Only where the premise holds, checked rather than assumed, else every layer is built and
measured (where a check after the shallow builds fails, the assumptions say which): a model
type whose layers are all alike (:data:`UNIFORM_TYPES`, ``layer_types`` all equal), every model of the run as deep as the policy
and its layers identical after PEFT (parameters, shapes, dtypes, trainable flags), one process
(FSDP2 / DeepSpeed wrap the layers into units and buckets of their own), checkpointing on
every layer or none (``train.checkpoint_every`` > 1 makes the layers alike in pairs), the
steady-state step with the optimizer state created untracked (a tracked step 0 creates it
parameter by parameter, a peak whose place moves with depth), the two measurements agreeing in
everything but sizes, every phase's peak found among its labelled moments. ``tests/unit/estimate/test_layers.py`` checks the extrapolated estimate
against the estimate of every layer, byte for byte, across methods and techniques.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memlab.measure.memory import MemoryProbe, categorize
from memlab.trainer.routing import base_model

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.estimate.decode import ShortDecode
    from memlab.estimate.fake import Measured
    from memlab.estimate.options import EstimateOptions

MEASURED = (3, 4)
"""The depths measured: at 3 the middle layer is both the second and the second-to-last."""
MIN_DEPTH = 8
"""Shallower models are measured whole (two measured depths cost 7 layers)."""
UNIFORM_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model types whose decoder layers are all alike, but for ``layer_types`` (checked)."""


def repeated_depth(ctx: BuildContext, opts: EstimateOptions) -> int | None:
    """The policy's depth when this estimate can measure :data:`MEASURED` depths instead (the
    premises that can be checked before a build), else None."""
    from memlab.estimate.standins import ModelStandin

    dist = ctx.distributed
    if ctx.world_size > 1 or dist.sharding() is not None or dist.as_step_owner() is not None:
        return None  # FSDP2 / DeepSpeed: units and buckets of their own
    if opts.run_first_step or ctx.train.steps == 1:
        return None  # step 0 creates the optimizer state parameter by parameter
    if ctx.train.gradient_checkpointing and ctx.train.checkpoint_every > 1:
        return None  # every other layer recomputes: alike in pairs, not one by one
    standin = ModelStandin(opts.config_overrides, [], None)
    try:
        cfg = standin.config(ctx.model, standin.load_tokenizer(ctx))
    except Exception:  # noqa: BLE001 - the full build reports it
        return None
    depth = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < MIN_DEPTH:
        return None
    if getattr(cfg, "model_type", None) not in UNIFORM_TYPES:
        return None
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(set(types)) > 1:
        return None
    return depth


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model`` (its ``_no_split_modules`` classes), in order."""
    names = set(getattr(base_model(model), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def _signature(layer: nn.Module) -> tuple:
    return (getattr(layer, "gradient_checkpointing", None),
            tuple((n, type(m).__name__) for n, m in layer.named_modules()),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in layer.named_parameters()))


def _labels(key: str, kind: str, i: int, depth: int) -> tuple:
    """A layer's region labels: by its place from the start (0, 1) and from the end (-1, -2);
    the layers between are ``mid`` (none at the measured depths)."""
    places: list[Any] = [p for p in (i if i < 2 else None, i - depth if i >= depth - 2 else None)
                         if p is not None]
    return tuple((key, kind, p) for p in (places or ["mid"]))


@dataclasses.dataclass
class LayerRecord:
    """The region labels of one build's layers and the tracker's phase log they fill."""

    depth: int
    loaded: list[int | None]
    """The depth each model of the run would have had (ModelStandin.loaded_layers)."""
    tracker: Any
    decode: ShortDecode
    log: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    problem: str | None = None
    handles: list[Any] = dataclasses.field(default_factory=list)
    patches: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

    @classmethod
    def start(cls, models: dict[str, nn.Module], tracker: Any, depth: int,
              loaded: list[int | None], decode: ShortDecode) -> LayerRecord:
        """Label every layer of every model of the run (its ``depth`` layers), and each
        layer of a KV cache the shortened decode grows."""
        rec = cls(depth=depth, loaded=loaded, tracker=tracker, decode=decode)
        tracker.phase_log = rec.log
        tracker.enter_region((("start",),))  # until a layer runs
        decode.on_grow = lambda i, n: tracker.enter_region(_labels("cache", "grow", i, n))
        rec._label_cache_calls()
        for key, model in models.items():
            layers = decoder_layers(model)
            if len(layers) != depth:
                rec.problem = f"the {key} model has {len(layers)} layers memlab can label"
                continue
            if len({_signature(layer) for layer in layers}) > 1:
                rec.problem = f"the layers of the {key} model differ (after PEFT)"
            for i, layer in enumerate(layers):
                rec._label(layer, key, i)
        return rec

    def _label(self, layer: nn.Module, key: str, i: int) -> None:
        tracker, depth = self.tracker, self.depth
        fw, after, bw = (_labels(key, kind, i, depth) for kind in ("fw", "after", "bw"))

        def enter(module, args):
            tracker.enter_region(fw)

        def leave(module, args, out):
            tracker.enter_region(after)
            first = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(backward)

        def backward(grad):
            tracker.enter_region(bw)

        self.handles += [layer.register_forward_pre_hook(enter),
                         layer.register_forward_hook(leave)]

    def _label_cache_calls(self) -> None:
        """A KV cache's calls that loop over its layers outside the layers' forward (the
        cache repeated for ``num_generations``, cropped, reordered): each layer's call a
        region, numbered within the loop."""
        from transformers.cache_utils import DynamicLayer

        from memlab.measure.patches import patched

        tracker, depth = self.tracker, self.depth
        state: dict[str, Any] = {"k": 0, "labels": None}

        def wrap(name: str, original: Any) -> Any:
            def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
                if tracker.region is not state["labels"]:  # a new loop starts
                    state["k"] = 0
                labels = _labels("cache", name, state["k"] % depth, depth)
                state["k"] += 1
                tracker.enter_region(labels)
                state["labels"] = labels
                return original(layer, *args, **kwargs)
            return call

        for name in ("batch_repeat_interleave", "batch_select_indices", "crop",
                     "reorder_cache"):
            original = getattr(DynamicLayer, name, None)
            if original is not None:
                self.patches.enter_context(patched(DynamicLayer, name, wrap(name, original)))

    def stop(self) -> None:
        self.patches.close()
        for h in self.handles:
            h.remove()
        self.handles = []
        self.tracker.phase_log = None
        self.tracker.region = ()
        self.decode.on_grow = None


def _line(a: Any, b: Any, depth: int) -> Any:
    """``a`` (measured at MEASURED[0]) and ``b`` (at MEASURED[1]) extended to ``depth``:
    integers along their line, everything else equal (ValueError where not)."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or isinstance(a, str):
        if a != b:
            raise ValueError(f"{a!r} != {b!r}")
        return a
    if isinstance(a, int) and isinstance(b, int):
        lo, hi = MEASURED
        return a + (b - a) * (depth - lo) // (hi - lo)
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            raise ValueError(f"keys {sorted(map(str, a))} != {sorted(map(str, b))}")
        return {k: _line(a[k], b[k], depth) for k in a}
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise ValueError(f"lengths {len(a)} != {len(b)}")
        return type(a)(_line(x, y, depth) for x, y in zip(a, b, strict=True))
    if a != b:
        raise ValueError(f"{a!r} != {b!r}")
    return a


def _visits(phase: dict[str, Any]) -> dict[tuple, list]:
    """A phase's visits by (label, how many visits of that label came before): a visit of
    the middle layer at 3 layers answers for both of its labels."""
    seen: dict[Any, int] = {}
    out = {}
    for visit in phase["visits"]:
        for label in visit[0]:
            out[(label, seen.get(label, 0))] = visit
            seen[label] = seen.get(label, 0) + 1
    return out


def _top(moments: list[tuple]) -> tuple:
    """The first moment of the largest total (the last entry of each moment)."""
    return max(moments, key=lambda m: m[-1])  # max() keeps the first of equals


def _phase(pa: dict[str, Any], pb: dict[str, Any], depth: int) -> tuple[int, tuple]:
    """The peak of one phase at ``depth`` and its moment, from the phase at the two measured
    depths: every moment of a visit that ran the same ops at both depths along its own line;
    a visit whose ops grow with depth (a loop over the parameters or the cache's layers) by
    its largest moment, where that moment grows with depth at least as fast as the visit's
    first and last moments (a moment that grows faster could overtake it deeper: the cache
    of a generate call alive at a visit's start, freed before its peak)."""
    for p in (pa, pb):
        top = max((m[-1] for v in p["visits"] for m in v[1]), default=0)
        if top != p["peak"]:
            raise ValueError(f"the peak of phase {p['phase']} of step {p['step']} is not in a "
                             "labelled moment")
    if (pa["step"], pa["phase"], pa["training"]) != (pb["step"], pb["phase"], pb["training"]):
        raise ValueError("the phases differ")
    va, vb = _visits(pa), _visits(pb)
    if va.keys() != vb.keys():
        raise ValueError(f"the regions of phase {pa['phase']} differ")
    best: tuple | None = None
    lo, hi = MEASURED
    for key, (_, moments, ops) in vb.items():  # (in time order: one label a visit)
        a_moments, a_ops = va[key][1], va[key][2]
        if not moments and not a_moments:
            continue
        if len(a_moments) == len(moments) and a_ops == ops:  # (_line, moment by moment)
            top = _top([tuple(x + (y - x) * (depth - lo) // (hi - lo) for x, y in zip(
                ma, mb, strict=True)) for ma, mb in zip(a_moments, moments, strict=True)])
        else:
            if not moments or not a_moments:
                raise ValueError(f"visit {key} ran at one depth only")
            ta, tb = _top(a_moments), _top(moments)
            grows = tb[-1] - ta[-1]
            if grows < max(moments[0][-1] - a_moments[0][-1], moments[-1][-1] - a_moments[-1][-1]):
                raise ValueError(f"in visit {key} memory grows faster with depth elsewhere than "
                                 "at its peak")
            top = _line(ta, tb, depth)
        if min(top) < 0:
            raise ValueError(f"visit {key} shrinks with depth")
        if best is None or top[-1] > best[-1]:
            best = top
    return (best[-1], best) if best is not None else (0, ())


def extrapolate(runs: list[Measured], depth: int) -> tuple[Measured | None, str]:
    """The measurement of the model at ``depth`` from ``runs`` at :data:`MEASURED` depths;
    ``(None, why)`` where a premise fails (module docstring)."""
    a, b = runs
    for r in runs:
        assert r.layers is not None
        if r.layers.problem:
            return None, r.layers.problem
        if any(n != depth for n in r.layers.loaded):
            return None, "the run's models differ in depth"
    try:
        if a.notes != b.notes:
            raise ValueError("the assumptions differ")
        for x, y in ((a.ran, b.ran), (a.run_steps, b.run_steps), (a.trained, b.trained),
                     (a.eval_phase, b.eval_phase), (a.decode_skipped, b.decode_skipped),
                     ([c.description for c in a.cands], [c.description for c in b.cands])):
            if x != y:
                raise ValueError("the batches or steps differ")
        log_a, log_b = a.layers.log, b.layers.log
        if len(log_a) != len(log_b):
            raise ValueError(f"{len(log_a)} phases at {MEASURED[0]} layers, {len(log_b)} at "
                             f"{MEASURED[1]}")
        phases = [(pb, *_phase(pa, pb, depth)) for pa, pb in zip(log_a, log_b, strict=True)]
        model = _line(a.model, b.model, depth)
        flops = _line(a.flops, b.flops, depth)
        assumed = _line(a.assumed, b.assumed, depth)
        offload = _line(a.offload, b.offload, depth)
    except ValueError as e:
        return None, f"the measurements at {MEASURED[0]} and {MEASURED[1]} layers disagree " \
                     f"({e})"
    probe = MemoryProbe("cpu", enabled=False)
    probe.tracked_steps = list(b.probe.tracked_steps)
    keys = b.probe.tracker.moment_keys  # type: ignore[union-attr]
    for entry, peak, moment in phases:
        probe.replay_phase(entry["step"], entry["phase"], entry["training"], peak, categorize(
            {k: v for k, v in zip(keys[:-1], moment[:-1], strict=True)}))
    for c, k in zip(b.eval_cands, b.eval_phase, strict=True):
        c.peak = phases[k][1]
    notes = [*b.notes, f"layers: the model's {depth} decoder layers measured at {MEASURED[0]} "
             f"and {MEASURED[1]} layers, the memory after every op labelled by the part of the "
             "step running (embedding, first and last two layers, head and loss, optimizer), "
             "each moment's bytes by category, the parameters and the FLOPs extended along "
             f"their line to {depth} (the layers are alike: exact; memlab.estimate.layers; "
             "--every-layer builds them all)"]
    timing = {k: a.timing[k] + b.timing[k] for k in b.timing}
    return dataclasses.replace(b, notes=notes, probe=probe, model=model, flops=flops,
                               assumed=assumed, offload=offload, timing=timing,
                               layers=None), ""
