"""Which candidates ``memlab fit`` estimates: the same answer as estimating every one, with fewer.

Three levers, each exact (the search finds the same fitting candidates, in the same predicted
order, with the same estimates, as an exhaustive one: ``tests/integration/test_fit_prune.py``
compares the two; ``--exhaustive`` turns the levers off):

1. **Twins, estimated once** (:func:`estimate_key`): candidates that are the same configuration
   as far as the estimate can tell share one estimate. An attention backend that cannot train
   on the CPU (flex, flash-attention) is estimated as per-document sdpa
   (:func:`memlab.estimate.fake.measure` swaps it), so on a CUDA target its candidates are
   their sdpa twins' estimate, where the two validate alike (the same dtypes, packed-row
   isolation, shared prefixes, no package to check and no rule of its own). (A precision option
   equal to the configured one is not a candidate at all: :func:`.space.dimensions`.)
2. **Monotone in the micro-batch** (:func:`Plan.pruned`): a micro-batch that does not fit
   rules out the larger ones with the same settings that also accumulate (the estimate runs two
   micro-batches of either, the second with the first's gradients alive: the same step on more
   rows). One micro-batch a step is not compared: without accumulation no gradient is alive
   in its forward, and where gradients outweigh the activations saved (a tiny model) the
   whole batch at once needs less than half of it twice; nor is the step inside backward.
3. **Dominated** (:func:`Plan.pruned`, :meth:`Plan._dominates`): a candidate is not estimated
   when a fitting one of the same other settings is predicted no slower by the speed model and
   ranks before it (:func:`.search.rank`), so fit would never choose it. That fitting one
   differs only in the dimensions whose options keep the FLOPs of a step or add to them, never
   offloads, and is at least as good in each of the speed model's keys
   (:func:`.search.rank_key`: seconds, then micro-batches a step, then padding, then
   checkpointing and offloading), better in one of them:

   - less or equal checkpointing: recomputation only adds FLOPs (and host copies only add
     seconds: the one that offloads is never the one that dominates);
   - one micro-batch a step (``32 x 1``) against one that accumulates (``16 x 2``, ``1 x 32``):
     the same rows of the step, each running the same ops whichever micro-batch holds it, so
     the same FLOPs a step (equal in every pair estimated at real size), and fewer
     micro-batches rank first. One micro-batch a step is estimated first; two accumulating
     options are not compared this way (lever 2 compares them the other way round: a smaller
     one that does not fit rules out the larger);
   - padding-free against padded rows (unpacked): the same tokens without the padding, never
     more FLOPs (equal in every pair estimated at real size), and no padding ranks first.

   Not where the configuration offloads activations and fit does not search it (each
   candidate would copy to the host, by amounts this rule cannot compare).

4. **Stopped over the budget** (:func:`.search.estimate_candidate`): an estimate stops at the
   first tracked moment that shows its need is larger than fits (:class:`memlab.estimate.modes.
   Stop`: every tracked moment is at most the peak, and a model measured at two shallow depths
   needs at least as much at its own; in the deeper build, a stretch of moments extended to
   the model's depth, :class:`memlab.estimate.layers.LineStop`, is part of what the peak is
   taken from); the candidate is ``over_budget`` with the need it had reached,
   ``needed_at_least_bytes``.
5. **Too large to hold** (:meth:`Plan.pruned`, where ``params_bound``): a candidate whose
   parameters alone (with the CUDA context) need more than fits; its parameters are those of
   any estimated candidate that differs from it only in the dimensions that build the same
   weights (:data:`SAME_WEIGHTS`: checkpointing, the micro-batch split, offloading, the loss,
   packing, padding-free, the attention backend), one process holding them whole. The first
   candidate of each set of weights is estimated to its end (:meth:`Plan.stoppable`).

A candidate waits (:meth:`Plan.ready`) until every candidate that could prune it is settled;
the order (:meth:`Plan._order`) estimates those first: one micro-batch a step, then smaller
micro-batches, less checkpointing, no offloading, padding-free first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memlab.cli.fit.space import Candidate, Dimension
from memlab.cli.fit.speed import micro_batches, padded

CKPT, MICRO, OFFLOAD, ATTENTION = "checkpointing", "micro_batch", "offload", "attention"
PADDING_FREE = "padding_free"
SAME_WEIGHTS = frozenset({CKPT, MICRO, OFFLOAD, ATTENTION, "loss", "packing", "padding_free"})
"""Dimensions whose options build the same parameters (the rest - PEFT, precision, sharding,
the optimizer - may not)."""


def _attention_name(overrides: Sequence[str]) -> str | None:
    for o in overrides:
        if o.startswith("attention="):
            return o.split("=", 1)[1]
    return None


def estimated_alike(name: str, twin: str = "sdpa") -> bool:
    """Whether ``attention=name`` is estimated exactly as ``attention=twin`` (sdpa, its yaml's
    knobs) on a CUDA target: the estimate runs a backend that cannot train on the CPU as
    per-document sdpa, and the two must validate alike."""
    from memlab import registry
    from memlab.attention.base import Backend

    try:
        cls, ref = registry.lookup("attention", name), registry.lookup("attention", twin)
    except KeyError:
        return False
    if name == twin:
        return True
    if not (issubclass(cls, Backend) and issubclass(ref, Backend)):
        return False
    estimated_as_sdpa = not (cls.trains_on_cpu and "cpu" in cls.devices)
    return (estimated_as_sdpa and twin == "sdpa" and "cuda" in cls.devices
            and cls.package is None and set(cls.dtypes) == set(ref.dtypes)
            and cls.isolates_packed == ref.isolates_packed
            and cls().shares_prefix() == ref().shares_prefix()
            and cls.validate is Backend.validate and ref.validate is Backend.validate)


def estimate_key(c: Candidate, dims: Sequence[Dimension], device: str) -> tuple[int, ...]:
    """What determines ``c``'s estimate: its coordinates, with an attention backend the
    estimate runs as sdpa on a CUDA target (:func:`estimated_alike`) at sdpa's."""
    key = []
    for d in dims:
        i = c.coords[d.name]
        if d.name == ATTENTION and device == "cuda":
            names = [_attention_name(opts) for _, opts in d.options]
            mine = names[i]
            if "sdpa" in names and mine is not None and estimated_alike(mine):
                i = names.index("sdpa")
        key.append(i)
    return tuple(key)


def _micro_size(opts: Sequence[str]) -> int | None:
    """The rows of a micro-batch option that accumulates (None: one micro-batch a step, or the
    step inside backward: not compared)."""
    values = dict(o.split("=", 1) for o in opts)
    if values.get("optimizer.in_backward") == "true" or int(values.get("train.grad_accum",
                                                                       1)) < 2:
        return None
    return int(values["train.batch_size"]) if "train.batch_size" in values else None


@dataclass
class Plan:
    """The search's bookkeeping: which candidate is estimated, shared or pruned, and when."""

    cands: list[Candidate]
    dims: list[Dimension]
    device: str = "cpu"
    prune: bool = True
    """False: every candidate is estimated (``--exhaustive``; twins too)."""
    offload_configured: bool = False
    """The configuration offloads activations and fit does not search it: less checkpointing
    would offload more, so it dominates nothing."""
    reps: list[int] = field(default_factory=list)
    """One candidate per estimate key, in the order they are estimated."""
    twins: dict[int, list[int]] = field(default_factory=dict)
    """A representative's index -> the candidates that share its estimate."""
    done: set[int] = field(default_factory=set)
    """Representatives settled: estimated or pruned."""
    made: list[int] = field(default_factory=list)
    """The candidates estimated, in the order their estimates came."""
    fits_below: int | None = None
    """The largest need that fits (the budget with the margin); with ``params_bound``, a
    candidate whose parameters alone need more is not estimated (lever 5)."""
    params_bound: bool = False
    """One process holds the parameters whole (no sharding): lever 5 applies."""

    def __post_init__(self) -> None:
        names = [d.name for d in self.dims]
        self._i = {n: names.index(n) for n in (CKPT, MICRO, OFFLOAD) if n in names}
        micro = next((d for d in self.dims if d.name == MICRO), None)
        self._sizes = [] if micro is None else [_micro_size(o) for _, o in micro.options]
        # the speed model's keys (.speed.score) lever 3 compares, once per candidate
        self._accums = [micro_batches(c) for c in self.cands]
        self._pads = [padded(c) for c in self.cands]
        by_key: dict[tuple[int, ...], int] = {}
        for i, c in enumerate(self.cands):
            key = (estimate_key(c, self.dims, self.device) if self.prune
                   else tuple(c.coords.values()) + (i,))
            rep = by_key.setdefault(key, i)
            if rep == i:
                self.twins[i] = []
            else:
                self.twins[rep].append(i)
        self.reps = sorted(self.twins, key=self._order)
        self._lines: dict[tuple[Any, ...], list[int]] = {}
        for r in self.reps:
            self._lines.setdefault(self._line(r), []).append(r)
        self._held: dict[tuple[Any, ...], tuple[int, int]] = {}
        """The parameters' need (with the CUDA context) of each set of weights, and the
        candidate whose estimate says so."""
        self._weighed: set[tuple[Any, ...]] = set()
        """The sets of weights a candidate was sent to be estimated whole for (lever 5)."""

    # ------------------------------------------------------------------ order and waiting
    def _coord(self, i: int, name: str) -> int:
        return self.cands[i].coords.get(name, 0)

    def _size(self, i: int) -> int | None:
        return self._sizes[self._coord(i, MICRO)] if self._sizes else None

    def _order(self, i: int) -> tuple[Any, ...]:
        size = self._size(i)
        return (size is not None, size or 0, self._coord(i, CKPT), self._coord(i, OFFLOAD),
                self._pads[i], i)

    def _weights(self, i: int) -> tuple[Any, ...]:
        """The coordinates that may change the parameters (outside :data:`SAME_WEIGHTS`)."""
        return tuple(v for k, v in self.cands[i].coords.items() if k not in SAME_WEIGHTS)

    def _line(self, i: int) -> tuple[Any, ...]:
        """The coordinates other than checkpointing, micro-batch, offloading and padding-free
        (the dimensions levers 2 and 3 compare)."""
        return tuple(v for k, v in self.cands[i].coords.items()
                     if k not in (CKPT, MICRO, OFFLOAD, PADDING_FREE))

    def _pruners(self, i: int) -> list[int]:
        """The candidates whose estimates could prune ``i`` (:meth:`pruned`)."""
        if not self.prune:
            return []
        me = self.cands[i].coords
        out = []
        for j in self._lines[self._line(i)]:
            if j == i:
                continue
            other = self.cands[j].coords
            if self._dominates(j, i):
                out.append(j)
            elif (other.get(CKPT) == me.get(CKPT) and other.get(OFFLOAD) == me.get(OFFLOAD)
                  and other.get(PADDING_FREE) == me.get(PADDING_FREE)
                  and self._smaller(j, i)):
                out.append(j)
        return out

    def _dominates(self, j: int, i: int) -> bool:
        """Whether ``j`` would dominate ``i`` if it fits (the same other settings, checked by
        the caller; lever 3): ``j`` offloads nothing, checkpoints no more, takes no more
        micro-batches a step and is no more padded (the speed model's keys, each predicting
        ``i`` no faster), better in one of them; a different micro-batch only where ``j``
        takes one a step and ``i`` accumulates."""
        if self.offload_configured:
            return False
        cj, ci = self._coord(j, CKPT), self._coord(i, CKPT)
        oj, oi = self._coord(j, OFFLOAD), self._coord(i, OFFLOAD)
        aj, ai = self._accums[j], self._accums[i]
        pj, pi = self._pads[j], self._pads[i]
        if oj != 0 or cj > ci or aj > ai or pj > pi:
            return False
        if self._coord(j, MICRO) != self._coord(i, MICRO) and not (
                self._size(j) is None and aj < ai):
            return False
        if self._coord(j, PADDING_FREE) != self._coord(i, PADDING_FREE) and pj == pi:
            return False  # (packed rows: padding-free is no key of the speed model there)
        return aj < ai or pj < pi or cj + oj < ci + oi

    def dominance(self, j: int, i: int) -> str:
        """What ``j`` does better than the ``i`` it dominates, in words (its lever)."""
        if self._coord(j, MICRO) != self._coord(i, MICRO):
            return "micro_batch"
        if self._coord(j, PADDING_FREE) != self._coord(i, PADDING_FREE):
            return "padding_free"
        return "checkpointing"

    def _smaller(self, j: int, i: int) -> bool:
        a, b = self._size(j), self._size(i)
        return a is not None and b is not None and a < b

    def ready(self, i: int) -> bool:
        """Every candidate that could prune ``i`` is settled."""
        return all(j in self.done for j in self._pruners(i))

    def stoppable(self, i: int) -> bool:
        """Whether ``i``'s estimate may stop once its need is past the budget (lever 4): not
        with ``prune`` off, nor the first of its weights where ``params_bound`` (estimated
        whole, it says what the weights need: lever 5 then spares the others of the same
        weights that cannot hold them)."""
        if not self.prune:
            return False
        if not self.params_bound or self._weights(i) in self._weighed:
            return True
        self._weighed.add(self._weights(i))
        return False

    # ------------------------------------------------------------------ pruning
    def pruned(self, i: int) -> dict[str, Any] | None:
        """Why ``i`` need not be estimated, from the settled candidates (None: estimate it)."""
        if self.prune and self.params_bound and self.fits_below is not None:
            held = self._held.get(self._weights(i))
            if held is not None and held[0] > self.fits_below:
                return {"reason": "parameters", "by": held[1], "at_least_bytes": held[0],
                        "why": f"its parameters alone need {held[0] / 2**30:.2f} GiB (as #"
                               f"{held[1]}'s estimate, of the same weights, says), more than "
                               "fits"}
        for j in self._pruners(i):
            e = self.cands[j].estimate
            if self._smaller(j, i) and e.get("status") in ("ok", "over_budget") \
                    and not e.get("fits"):
                return {"reason": "no_fit", "by": j,
                        "at_least_bytes": e.get("needed_bytes") or e.get(
                            "needed_at_least_bytes"),
                        "why": f"a smaller micro-batch of the same settings does not fit (#{j})"}
        for j in self._pruners(i):
            if self._dominates(j, i) and self.cands[j].estimate.get("fits"):
                lever = self.dominance(j, i)
                what = {"micro_batch": "one micro-batch a step (the same FLOPs)",
                        "padding_free": "padding-free rows (no more FLOPs)",
                        "checkpointing": "less checkpointing or no offloading"}[lever]
                return {"reason": "dominated", "by": j, "lever": lever,
                        "why": f"#{j} fits with {what} and is predicted no slower, ranked "
                               "first"}
        return None

    def settle(self, i: int, estimate: dict[str, Any] | None = None,
               pruned: dict[str, Any] | None = None) -> list[int]:
        """Record representative ``i``'s estimate (or why it was pruned) on it and its twins;
        returns the candidates it settled."""
        self.done.add(i)
        if estimate is not None:
            self.made.append(i)
            cats = estimate.get("by_category") or {}
            if estimate.get("status") == "ok" and "parameters" in cats \
                    and estimate.get("needed_bytes") is not None:
                context = estimate["needed_bytes"] - (estimate.get("peak_bytes") or 0)
                self._held.setdefault(self._weights(i), (cats["parameters"] + context, i))
        out = [i, *self.twins.get(i, [])]
        for k in out:
            c = self.cands[k]
            if estimate is not None:
                c.estimate = estimate if k == i else {**estimate, "seconds": 0.0, "cpu_s": 0.0}
                c.shared = None if k == i else i
            c.pruned = pruned
        return out

    def counts(self) -> dict[str, int]:
        """Candidates estimated, sharing an estimate, pruned (by reason), left."""
        out = {"candidates": len(self.cands), "estimated": 0, "stopped": 0, "shared": 0,
               "no_fit": 0, "parameters": 0, "dominated": 0, "left": 0}
        for c in self.cands:
            if c.pruned:
                out[c.pruned["reason"]] += 1
            elif c.shared is not None:
                out["shared"] += 1
            elif c.estimate.get("status") == "over_budget":
                out["stopped"] += 1
            elif c.estimate:
                out["estimated"] += 1
            else:
                out["left"] += 1
        return out
