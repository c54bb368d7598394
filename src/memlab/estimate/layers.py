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

Checkpointing every second layer (``train.checkpoint_every=2``) makes the layers alike in
pairs: the even ones recompute, the odd ones keep their activations. Within each class the
same argument holds (a layer's moment is linear in how many layers of each class came before
it, which is linear in ``L`` at a fixed place from either end, for depths of the same parity),
so each class's largest moment is at its first or last layer that is neither the model's first
nor its last: the first three and the last three layers are labelled, and the model is
measured at 4 and 6 layers (5 and 7 for an odd depth, four labelled at each end:
:data:`IN_PAIRS`), every layer of both depths labelled.

Only where the premise holds, checked rather than assumed, else every layer is built and
measured (where a check after the shallow builds fails, the assumptions say which): a model
type whose layers are all alike (:data:`UNIFORM_TYPES`, ``layer_types`` all equal), every model of the run as deep as the policy
and its layers identical after PEFT (parameters, shapes, dtypes, trainable flags, the
checkpointing flag: within each class), one process
(FSDP2 / DeepSpeed wrap the layers into units and buckets of their own), checkpointing on
every layer, every second or none (every third and beyond: built whole), a model deeper than
the two measured depths together, the
steady-state step with the optimizer state created untracked (a tracked step 0 creates it
parameter by parameter, a peak whose place moves with depth), the two measurements agreeing in
everything but sizes, every phase's peak found among its labelled moments. ``tests/unit/estimate/test_layers.py`` checks the extrapolated estimate
against the estimate of every layer, byte for byte, across methods and techniques.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memlab.measure.memory import MemoryProbe, categorize
from memlab.trainer.routing import base_model

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.estimate.decode import ShortDecode
    from memlab.estimate.measured import Measured
    from memlab.estimate.options import EstimateOptions

MEASURED = (3, 4)
"""The depths measured where every layer is alike: at 3 the middle layer is both the second and
the second-to-last."""
IN_PAIRS = {0: ((4, 6), 3), 1: ((5, 7), 4)}
"""By the model's depth % 2, the depths measured and the layers labelled at each end where the
layers are alike in pairs (``train.checkpoint_every=2``: the even layers recompute, the odd
ones keep their activations): the measured depths as even or odd as the model's, each class's
first and last layer that has a layer before and after it labelled, and every layer of both
measured depths labelled (at 4 the second is also the third-to-last)."""
MIN_DEPTH = sum(MEASURED) + 1
"""Shallower models are measured whole (two measured depths cost 7 layers): any model the
measured depths would not be cheaper for is (:func:`repeated_depth`)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a model of ``depth`` layers is measured: at the two ``measured`` depths, its layers
    alike in classes ``i % period`` (checkpointing every ``period``-th layer), the first and the
    last ``ends`` labelled (:func:`_labels`): each class's first and last layer with another
    layer before and after it (the first and the last layer of the model differ)."""

    depth: int
    period: int = 1
    measured: tuple[int, int] = MEASURED
    ends: int = 2


UNIFORM_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model types whose decoder layers are all alike, but for ``layer_types`` (checked)."""


def repeated_depth(ctx: BuildContext, opts: EstimateOptions) -> Plan | None:
    """How the policy is measured at two shallow depths where this estimate can (the premises
    that can be checked before a build), else None."""
    from memlab.estimate.standins import ModelStandin

    dist = ctx.distributed
    if ctx.world_size > 1 or dist.sharding() is not None or dist.as_step_owner() is not None:
        return None  # FSDP2 / DeepSpeed: units and buckets of their own
    steps = ctx.train.fixed_steps()  # None: train.epochs, counted on the rows at the build
    if opts.run_first_step or steps == 1 or (steps is None and opts.from_data):
        return None  # step 0 creates the optimizer state parameter by parameter
    period = ctx.train.checkpoint_every if ctx.train.gradient_checkpointing else 1
    if period > 2:
        return None  # alike in triples and more: measured depths that cost less are rare
    standin = ModelStandin(opts.config_overrides, [], None)
    try:
        cfg = standin.config(ctx.model, standin.load_tokenizer(ctx))
    except Exception:  # noqa: BLE001 - the full build reports it
        return None
    depth = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(depth, int):
        return None
    measured, ends = (MEASURED, 2) if period == 1 else IN_PAIRS[depth % 2]
    if depth <= sum(measured):  # (MIN_DEPTH: at least 8 layers, 11 in pairs)
        return None
    if getattr(cfg, "model_type", None) not in UNIFORM_TYPES:
        return None
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list) and len(set(types)) > 1:
        return None
    return Plan(depth, period, measured, ends)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model`` (its ``_no_split_modules`` classes), in order."""
    names = set(getattr(base_model(model), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def _signature(layer: nn.Module) -> tuple:
    return (getattr(layer, "gradient_checkpointing", None),
            tuple((n, type(m).__name__) for n, m in layer.named_modules()),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in layer.named_parameters()))


def _labels(key: str, kind: str, i: int, depth: int, ends: int = 2) -> tuple:
    """A layer's region labels: by its place from the start (0, 1, ... ``ends`` - 1) and from
    the end (-1, -2, ... -``ends``); the layers between are ``mid`` (none at the measured
    depths)."""
    places: list[Any] = [p for p in (i if i < ends else None,
                                     i - depth if i >= depth - ends else None) if p is not None]
    return tuple((key, kind, p) for p in (places or ["mid"]))


@dataclasses.dataclass
class LayerRecord:
    """The region labels of one build's layers and the tracker's phase log they fill."""

    depth: int
    loaded: list[int | None]
    """The depth each model of the run would have had (ModelStandin.loaded_layers)."""
    plan: Plan
    tracker: Any
    decode: ShortDecode
    log: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    problem: str | None = None
    handles: list[Any] = dataclasses.field(default_factory=list)
    patches: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)

    @classmethod
    def start(cls, models: dict[str, nn.Module], tracker: Any, depth: int,
              loaded: list[int | None], decode: ShortDecode, plan: Plan) -> LayerRecord:
        """Label every layer of every model of the run (its ``depth`` layers), and each
        layer of a KV cache the shortened decode grows."""
        rec = cls(depth=depth, loaded=loaded, plan=plan, tracker=tracker, decode=decode)
        tracker.phase_log = rec.log
        tracker.enter_region((("start",),))  # until a layer runs
        ends = plan.ends
        decode.on_grow = lambda i, n: tracker.enter_region(_labels("cache", "grow", i, n, ends))
        rec._label_cache_calls()
        for key, model in models.items():
            layers = decoder_layers(model)
            if len(layers) != depth:
                rec.problem = f"the {key} model has {len(layers)} layers memlab can label"
                continue
            period = plan.period
            if any(len({_signature(layer) for layer in layers[c::period]}) > 1
                   for c in range(period)):
                rec.problem = f"the layers of the {key} model differ (after PEFT)" + (
                    f", compared every {period} layers" if period > 1 else "")
            for i, layer in enumerate(layers):
                rec._label(layer, key, i)
        return rec

    def _label(self, layer: nn.Module, key: str, i: int) -> None:
        tracker, depth = self.tracker, self.depth
        fw, after, bw = (_labels(key, kind, i, depth, self.plan.ends)
                         for kind in ("fw", "after", "bw"))

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
                labels = _labels("cache", name, state["k"] % depth, depth, self.plan.ends)
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


def _line(a: Any, b: Any, depth: int, measured: tuple[int, int] = MEASURED) -> Any:
    """``a`` (measured at ``measured[0]`` layers) and ``b`` (at ``measured[1]``) extended to
    ``depth``: integers along their line, everything else equal (ValueError where not)."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or isinstance(a, str):
        if a != b:
            raise ValueError(f"{a!r} != {b!r}")
        return a
    if isinstance(a, int) and isinstance(b, int):
        lo, hi = measured
        return a + (b - a) * (depth - lo) // (hi - lo)
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            raise ValueError(f"keys {sorted(map(str, a))} != {sorted(map(str, b))}")
        return {k: _line(a[k], b[k], depth, measured) for k in a}
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise ValueError(f"lengths {len(a)} != {len(b)}")
        return type(a)(_line(x, y, depth, measured) for x, y in zip(a, b, strict=True))
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


def _phase(pa: dict[str, Any], pb: dict[str, Any], depth: int,
           measured: tuple[int, int] = MEASURED) -> tuple[int, tuple]:
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
    lo, hi = measured
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
            top = _line(ta, tb, depth, measured)
        if min(top) < 0:
            raise ValueError(f"visit {key} shrinks with depth")
        if best is None or top[-1] > best[-1]:
            best = top
    return (best[-1], best) if best is not None else (0, ())


@dataclasses.dataclass
class Shallow:
    """What :func:`extrapolate` reads of a shallow build's :class:`Measured` (plain data: a
    build measured in a forked process sends it back, :mod:`memlab.estimate.forked`)."""

    notes: list[str]
    ran: list
    run_steps: list[int]
    trained: list
    eval_phase: list[int]
    decode_skipped: bool
    cands: list[str]
    """Each candidate batch's description."""
    log: list[dict[str, Any]]
    problem: str | None
    loaded: list[int | None]
    model: dict[str, Any]
    flops: Any
    assumed: dict[str, int]
    offload: Any
    timing: dict[str, float]

    @classmethod
    def of(cls, m: Measured) -> Shallow:
        rec = m.layers
        assert rec is not None
        return cls(notes=list(m.notes), ran=list(m.ran), run_steps=list(m.run_steps),
                   trained=m.trained, eval_phase=list(m.eval_phase),
                   decode_skipped=m.decode_skipped, cands=[c.description for c in m.cands],
                   log=rec.log, problem=rec.problem, loaded=list(rec.loaded), model=m.model,
                   flops=m.flops, assumed=dict(m.assumed), offload=m.offload,
                   timing=dict(m.timing))


class LineStop:
    """The deeper build's visits extended to the model's depth as they end, along the line
    from the shallower build's (:func:`_phase`'s moment-by-moment line, for a visit that ran
    the same ops at both depths): :func:`memlab.estimate.modes.estimate_tracker` stops the
    deeper build once one passes its :class:`~memlab.estimate.modes.Stop`'s limit. Such a
    visit's extended moments are among those the estimate takes its peak from, so the
    estimate's need is larger: a candidate of ``memlab fit`` that cannot fit stops here, in
    its deeper build, where its shallow builds alone stay within the budget (a deep model's
    activations). Exact where the estimate is the two depths' line, as every estimate of a
    model of alike layers is (checked before the builds; a visit that differs in its ops
    across the depths is not extended here)."""

    def __init__(self, shallow_log: list[dict[str, Any]], plan: Plan) -> None:
        self.log = shallow_log
        self.plan = plan
        self._phase = -1
        self._seen: dict[Any, int] = {}
        self._visits: dict[tuple, list] = {}

    def visit_top(self, p: int, phase: dict[str, Any], visit: list) -> int | None:
        """The largest total of the ended ``visit`` (the last of phase number ``p`` so far)
        at the model's depth, where the shallower build has its twin (None: none to compare)."""
        if p != self._phase:
            self._phase, self._seen = p, {}
            self._visits = _visits(self.log[p]) if p < len(self.log) else {}
        labels, moments, ops = visit
        keys = []
        for label in labels:
            keys.append((label, self._seen.get(label, 0)))
            self._seen[label] = self._seen.get(label, 0) + 1
        if not moments or p >= len(self.log):
            return None
        other = self.log[p]
        if (other["step"], other["phase"], other["training"]) != (
                phase["step"], phase["phase"], phase["training"]):
            return None
        twin = self._visits.get(keys[0])
        if twin is None or len(twin[1]) != len(moments) or twin[2] != ops:
            return None
        return max(_line(x[-1], y[-1], self.plan.depth, self.plan.measured)
                   for x, y in zip(twin[1], moments, strict=True))


def measure_shallow(plan: Plan, build: Callable[[int], Measured], *, parallel: bool = False
                    ) -> tuple[Measured | None, str]:
    """The model measured at ``plan.measured`` depths (``build(n)``: the run built and measured
    with ``n`` layers) and extended to its own (:func:`extrapolate`). ``parallel``: the
    shallower build in a forked process meanwhile (:mod:`memlab.estimate.forked`; measured
    here after all where the child gives no result or no process can be forked)."""
    from memlab.estimate.forked import Forked, ForkedFailed

    lo, hi = plan.measured
    child = None
    if parallel:
        try:
            child = Forked(lambda: Shallow.of(build(lo)))
        except OSError:  # no process to spare (ulimit, memory): one after the other
            child = None
    from memlab.estimate.modes import extending

    try:
        shallow = None if child is not None else Shallow.of(build(lo))
        # (under a Stop: the deeper build stops once a visit extended to the depth passes it)
        with extending(LineStop(shallow.log, plan) if shallow is not None else None):
            deeper = build(hi)
        if child is not None:
            try:
                shallow = child.result()
            except ForkedFailed:  # (an error of its own shows in this process too)
                shallow = Shallow.of(build(lo))
    finally:
        if child is not None:
            child.stop()
    assert shallow is not None
    return extrapolate(shallow, deeper, plan)


def extrapolate(shallow: Shallow, deeper: Measured, plan: Plan) -> tuple[Measured | None, str]:
    """The measurement of the model at ``plan.depth`` from its builds at ``plan.measured``
    depths (the shallower one as a :class:`Shallow`); ``(None, why)`` where a premise fails
    (module docstring)."""
    a, b = shallow, Shallow.of(deeper)
    depth, measured = plan.depth, plan.measured
    lo, hi = measured
    for r in (a, b):
        if r.problem:
            return None, r.problem
        if any(n != depth for n in r.loaded):
            return None, "the run's models differ in depth"
    try:
        if a.notes != b.notes:
            raise ValueError("the assumptions differ")
        for x, y in ((a.ran, b.ran), (a.run_steps, b.run_steps), (a.trained, b.trained),
                     (a.eval_phase, b.eval_phase), (a.decode_skipped, b.decode_skipped),
                     (a.cands, b.cands)):
            if x != y:
                raise ValueError("the batches or steps differ")
        log_a, log_b = a.log, b.log
        if len(log_a) != len(log_b):
            raise ValueError(f"{len(log_a)} phases at {lo} layers, {len(log_b)} at {hi}")
        phases = [(pb, *_phase(pa, pb, depth, measured))
                  for pa, pb in zip(log_a, log_b, strict=True)]
        model = _line(a.model, b.model, depth, measured)
        flops = _line(a.flops, b.flops, depth, measured)
        assumed = _line(a.assumed, b.assumed, depth, measured)
        offload = _line(a.offload, b.offload, depth, measured)
    except ValueError as e:
        return None, f"the measurements at {lo} and {hi} layers disagree " \
                     f"({e})"
    probe = MemoryProbe("cpu", enabled=False)
    probe.tracked_steps = list(deeper.probe.tracked_steps)
    keys = deeper.probe.tracker.moment_keys  # type: ignore[union-attr]
    for entry, peak, moment in phases:
        probe.replay_phase(entry["step"], entry["phase"], entry["training"], peak, categorize(
            {k: v for k, v in zip(keys[:-1], moment[:-1], strict=True)}))
    for c, k in zip(deeper.eval_cands, b.eval_phase, strict=True):
        c.peak = phases[k][1]
    pairs = f" (alike in pairs: train.checkpoint_every={plan.period})" if plan.period > 1 else ""
    ends = {2: "two", 3: "three", 4: "four"}.get(plan.ends, str(plan.ends))
    notes = [*b.notes, f"layers: the model's {depth} decoder layers measured at {lo} "
             f"and {hi} layers{pairs}, the memory after every op labelled by the part of the "
             f"step running (embedding, first and last {ends} layers, head and loss, optimizer), "
             "each moment's bytes by category, the parameters and the FLOPs extended along "
             f"their line to {depth} (the layers are alike: exact; memlab.estimate.layers; "
             "--every-layer builds them all)"]
    timing = {k: a.timing[k] + b.timing[k] for k in b.timing}
    return dataclasses.replace(deeper, notes=notes, probe=probe, model=model, flops=flops,
                               assumed=assumed, offload=offload, timing=timing,
                               layers=None), ""
