"""The modes and hooks an estimate's fake-tensor step runs under (:mod:`memlab.estimate.fake`):
transformers' value-dependent mask decisions taken on the real batch (:func:`exact_value_hooks`),
the run's memory tracker made cheaper per op (:func:`estimate_tracker`), a FakeTensorMode that
answers the value reads left (:func:`estimate_fake_mode`) and a FLOP count read from the shapes
(:class:`FlopCount`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.estimate.cache_key import prep_args_for_hash
from memlab.measure import patches
from memlab.measure.memory import tracker_class


@classmethod  # type: ignore[misc]
def _no_dynamo_guard(cls) -> bool:
    """``TorchDispatchMode._should_skip_dynamo`` for the estimator's modes: False. torch wraps
    every mode's ``__torch_dispatch__`` in ``torch._dynamo.disable`` (so that a compiled region
    does not trace into it), a Python frame and two eval-frame swaps on each of the ~45,000 ops
    of a real-size step, times every mode on the stack; nothing is compiled inside an
    estimate."""
    return False


def fake_dispatch(mode: FakeTensorMode, func, types, args=(), kwargs=None) -> Any:
    """FakeTensorMode's own ``__torch_dispatch__``, without the dynamo guard torch wraps it in
    (:func:`_no_dynamo_guard`): what a subclass calls for ``super().__torch_dispatch__``."""
    return _FAKE_DISPATCH(mode, func, types, args, kwargs or {})


_FAKE_DISPATCH = getattr(FakeTensorMode.__torch_dispatch__, "__wrapped__",
                         FakeTensorMode.__torch_dispatch__)


def _candidates(real: dict[str, torch.Tensor], suffix: str, fake: Any) -> list[torch.Tensor]:
    """The batch's real tensors named ``*suffix`` that ``fake`` can be (same shape, or the same
    after ``expand``, as transformers does with position_ids)."""
    if not isinstance(fake, torch.Tensor):
        return []
    out = []
    with unset_fake_temporarily():
        for name, r in real.items():
            if not name.endswith(suffix):
                continue
            if tuple(r.shape) == tuple(fake.shape):
                out.append(r)
            elif r.dim() == fake.dim():
                try:
                    out.append(r.expand(tuple(fake.shape)))
                except RuntimeError:
                    pass
    return out


def _same(values: list[Any]) -> bool:
    first = values[0]
    for v in values[1:]:
        if isinstance(first, torch.Tensor) or isinstance(v, torch.Tensor):
            if not (isinstance(first, torch.Tensor) and isinstance(v, torch.Tensor)
                    and first.shape == v.shape and torch.equal(first, v)):
                return False
        elif v != first:
            return False
    return True


@contextlib.contextmanager
def exact_value_hooks(real: dict[str, torch.Tensor], fake_mode,
                      dense_padding: bool = True) -> Iterator[None]:
    """Evaluate transformers' value-dependent mask decisions (causal-mask skip, packed-sequence
    detection) on the real batch tensors (module docstring). The fake argument is matched to the
    batch tensors of the same kind (``*attention_mask`` / ``*position_ids``) and shape; when
    several match and disagree, the fake-tensor behaviour (a materialised mask: the larger
    memory) is kept. ``dense_padding=False`` (sdpa standing in for flash / flex attention,
    which never build a dense mask: flash unpads the rows, flex builds a block mask) decides
    as if the rows had no padding. Scoped: restored on exit."""

    def decide(orig, suffix, fake, *args, convert=None, **kwargs):
        """orig(real, ...) if every real candidate gives the same answer, else orig(fake)."""
        cands = _candidates(real, suffix, fake)
        if not cands:
            return orig(fake, *args, **kwargs)
        with unset_fake_temporarily():
            answers = [orig(convert(c) if convert else c, *args, **kwargs) for c in cands]
            if not _same(answers):
                return orig(fake, *args, **kwargs)
        ans = answers[0]
        return fake_mode.from_tensor(ans) if isinstance(ans, torch.Tensor) else ans

    def find_packed(orig, position_ids):
        return decide(orig, "position_ids", position_ids)

    def ignore_causal(orig, padding_mask, *args, **kwargs):
        if padding_mask is None:
            return orig(padding_mask, *args, **kwargs)
        return decide(orig, "attention_mask", padding_mask, *args,
                      convert=(lambda t: t.bool()) if dense_padding else
                      (lambda t: torch.ones_like(t, dtype=torch.bool)), **kwargs)

    with patches.mask_decisions(find_packed, ignore_causal):
        yield


class Stop:
    """A limit on an estimate's tracked memory (:func:`stopping`): the first moment of a phase
    whose tracked memory passes ``limit`` bytes stops the estimate (:class:`OverBudget`), and
    ``hit`` keeps that memory. Every tracked moment of a phase is at most the estimate's peak
    (its phases' peaks are the largest of their moments; what is added afterwards - the cuBLAS
    workspace, a generation engine - only adds), and a model measured at two shallow depths
    (:mod:`memlab.estimate.layers`) needs at every moment at least what its shallower builds
    need at theirs (its layers are alike: each moment of the deep model has every tensor of
    the shallow one's, and those of the layers between), so the estimate's peak passes the
    limit too: what :func:`memlab.cli.fit.search.estimate_candidate` uses to stop estimating a
    candidate that cannot fit. In the deeper of the two builds, a visit's moments extended to
    the model's depth (:func:`extending`, :class:`memlab.estimate.layers.LineStop`) are
    compared with the limit too: they are among the moments the estimate's peak is taken
    from."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.hit: int | None = None


class OverBudget(Exception):
    """An estimate stopped by its :class:`Stop` (the memory is in ``Stop.hit``)."""


_STOP: list[Stop | None] = [None]
_LINE: list[Any] = [None]
"""The shallower build's phase log the deeper one's visits are extended along
(:func:`extending`; :class:`memlab.estimate.layers.LineStop`), or None."""


@contextlib.contextmanager
def stopping(stop: Stop | None) -> Iterator[Stop | None]:
    """Trackers made inside (:func:`estimate_tracker`) stop at ``stop`` (None: never)."""
    before = _STOP[0]
    _STOP[0] = stop
    try:
        yield stop
    finally:
        _STOP[0] = before


@contextlib.contextmanager
def extending(line: Any) -> Iterator[None]:
    """Trackers made inside (:func:`estimate_tracker`), under a :class:`Stop`, also stop at
    the end of a visit whose moments, extended along ``line`` to the model's depth
    (:class:`memlab.estimate.layers.LineStop`), pass the limit (None: no such check)."""
    before = _LINE[0]
    _LINE[0] = line
    try:
        yield
    finally:
        _LINE[0] = before


def estimate_tracker(round_to: int = 0):
    """The run's tracker class, optionally rounding each storage up to ``round_to`` bytes
    (the CUDA caching allocator's 512-byte blocks) while the fake tensors live on the CPU;
    made inside :func:`stopping`, it stops at the first moment of a phase past the limit."""
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import (
        _TOTAL_KEY,
        _MemRefType,
        _UpdateType,
        _WeakRefInfo,
        get_untyped_storages,
    )
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    base = tracker_class()
    stop = _STOP[0]
    line = _LINE[0] if stop is not None else None
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default
    device_query = torch.ops.prim.device.default
    add, delete, ref, size = (_UpdateType.ADD, _UpdateType.DEL, _UpdateType.REF,
                              _UpdateType.SIZE)

    # (the base class is made at run time: mypy cannot check a class derived from a variable)
    class EstimateTracker(base):  # type: ignore[misc, valid-type]
        """The run's tracker; its per-op work made cheaper, the same storages tracked the same
        way: MemTracker's ``__torch_dispatch__`` walks the outputs with ``tree_map_only``
        (which wraps a new function on every call) and ``_update_snap`` builds a dict of every
        reference type on every call (an Enum walk) even when the device has one already."""

        region: tuple = ()
        """The labels of the part of the model running now (:meth:`enter_region`)."""
        phase_log: list[dict[str, Any]] | None = None
        """When a list (:mod:`memlab.estimate.layers`), every phase appends its step, name,
        peak and *visits*: each stretch of time one region ran, ``[labels, moments, ops]``,
        a moment (the memory by reference type, :attr:`moment_keys`, after each op) per op
        and a hash of the ops it ran."""
        moment_keys: tuple = ()
        _current: dict[str, Any] | None = None
        _should_skip_dynamo = _no_dynamo_guard

        def enter_region(self, labels: tuple) -> None:
            """The part of the model labelled ``labels`` starts running (a layer's hooks)."""
            self.region = labels
            cur = self._current
            if cur is not None:
                if line is not None:
                    self._visit_ends(cur)
                cur["visits"].append([labels, [], 0])

        def _visit_ends(self, cur: dict[str, Any]) -> None:
            """The last visit of the phase ``cur`` ended: stop where its moments, extended
            along ``line`` to the model's depth, pass the limit."""
            assert self.phase_log is not None and stop is not None and line is not None
            top = line.visit_top(len(self.phase_log), cur, cur["visits"][-1])
            if top is not None and top > stop.limit:
                stop.hit = int(top)
                raise OverBudget(f"tracked memory at depth {top} B > {stop.limit} B")

        _in_phase = False

        def phase_begins(self, step, name, training, device):
            self._in_phase = True
            if self.phase_log is None:
                return
            if not self.moment_keys:
                self.moment_keys = (*self._ref_class, _TOTAL_KEY)
            self._current = {"step": step, "phase": name, "training": training,
                             "device": device, "visits": [[self.region, [], 0]]}
            self._moment(None)  # the phase's peak starts from the memory it starts with

        def phase_ends(self):
            self._in_phase = False
            cur, self._current = self._current, None
            if cur is not None and line is not None and self.phase_log is not None:
                self._visit_ends(cur)
            if cur is not None and self.phase_log is not None:
                cur["peak"] = int(self._peak_mem.get(cur["device"], 0))
                self.phase_log.append(cur)

        def _moment(self, func) -> None:
            cur = self._current
            assert cur is not None
            snap = self._curr_mem_snap.get(cur["device"])
            visit = cur["visits"][-1]
            visit[1].append(tuple(snap.get(k, 0) for k in self.moment_keys) if snap
                            else (0,) * len(self.moment_keys))
            visit[2] = hash((visit[2], func))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.paused or func is device_query:
                return func(*args, **(kwargs or {}))
            if DTensor in types:
                return NotImplemented
            if func is wait_tensor and active_fake_mode():
                res = args[0]
            else:
                res = func(*args, **(kwargs or {}))
            if active_fake_mode() is self.entry_fake_mode:
                if self._in_opt:
                    reftype = _MemRefType.OPT
                elif self._mod_tracker.is_bw and not self._in_ac:
                    reftype = _MemRefType.TEMP
                else:
                    reftype = _MemRefType.ACT
                if isinstance(res, torch.Tensor):
                    self._track(reftype, res)
                elif res is not None:
                    for leaf in tree_leaves(res):
                        if isinstance(leaf, torch.Tensor):
                            self._track(reftype, leaf)
                self._update_peak_stats(None)
                if self._current is not None:
                    self._moment(func)
                if stop is not None and self._in_phase:
                    top = max(self._peak_mem.values(), default=0)
                    if top > stop.limit:
                        stop.hit = int(top)
                        raise OverBudget(f"tracked memory {top} B > {stop.limit} B")
            return res

        def _track(self, reftype, t: torch.Tensor) -> None:
            for st in get_untyped_storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is not None:
                    if winfo.size != st.size():
                        old = winfo.mem_consumed
                        winfo.update_mem_consumed(st)
                        self._update_snap(size, winfo, old_mem_consumed=old)
                    return
                winfo, w_st = _WeakRefInfo.create_winfo(st, t.device, reftype,
                                                       self._delete_callback)
                self._WINFO[st] = (winfo, w_st)
                if winfo.mem_consumed > 0:
                    self._update_snap(add, winfo)

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            if round_to and (u_type is add or u_type is size):
                raw = winfo.size * winfo.element_size
                winfo.mem_consumed = math.ceil(raw / round_to) * round_to if raw > 0 else 0
            snaps = self._curr_mem_snap
            dev_snap = snaps.get(winfo.device)
            if dev_snap is None:
                dev_snap = snaps[winfo.device] = dict.fromkeys(self._ref_class, 0)
                dev_snap[_TOTAL_KEY] = 0
            n = winfo.mem_consumed
            if u_type is add:
                dev_snap[winfo.reftype] += n
                dev_snap[_TOTAL_KEY] += n
            elif u_type is delete:
                dev_snap[winfo.reftype] -= n
                dev_snap[_TOTAL_KEY] -= n
            elif u_type is ref:
                dev_snap[old_reftype] -= n
                dev_snap[winfo.reftype] += n
            elif u_type is size:
                dev_snap[winfo.reftype] += n - old_mem_consumed
                dev_snap[_TOTAL_KEY] += n - old_mem_consumed
            else:
                raise ValueError(f"Invalid update type: {u_type}")
            if u_type is not add and u_type is not ref and dev_snap[_TOTAL_KEY] == 0:
                del snaps[winfo.device]


    return EstimateTracker()


def estimate_fake_mode():
    """A FakeTensorMode that answers the value reads a training step makes *after* the
    decisions :func:`exact_value_hooks` resolves from the real batch - in practice loss values
    and logging metrics: a floating scalar read (``float(t)``, ``.item()``, ``.tolist()``) gives
    NaN, a boolean read gives True, and a data-dependent shape (``nonzero``, boolean indexing,
    ``masked_select``) keeps every element (the upper bound). Integer reads still fail. The
    answers are counted in ``mode.assumed`` and reported."""
    aten = torch.ops.aten

    class EstimateFakeMode(FakeTensorMode):
        assumed: dict[str, int]
        _should_skip_dynamo = _no_dynamo_guard

        def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
            prep_args_for_hash(self, result, args, state, id_hashed_objects)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten._local_scalar_dense.default:
                x = args[0]
                if x.is_floating_point() or x.dtype == torch.bool:
                    kind = "float reads (NaN)" if x.is_floating_point() else \
                        "boolean reads (True)"
                    self.assumed[kind] = self.assumed.get(kind, 0) + 1
                    return float("nan") if x.is_floating_point() else True
            if func in (aten.nonzero.default, aten.masked_select.default):
                key = "data-dependent shapes (all elements kept)"
                self.assumed[key] = self.assumed.get(key, 0) + 1
                x = args[0]
                shape: tuple[int, ...]
                if func is aten.nonzero.default:
                    shape, dtype = (x.numel(), x.dim()), torch.long
                else:
                    shape = (torch.broadcast_shapes(x.shape, args[1].shape).numel(),)
                    dtype = x.dtype
                return fake_dispatch(
                    self, aten.empty.memory_format, types, (shape,),
                    {"dtype": dtype, "device": x.device})
            return fake_dispatch(self, func, types, args, kwargs)

    mode = EstimateFakeMode()
    mode.assumed = {}
    return mode


class FlopCount(TorchDispatchMode):
    """Floating-point operations of the ops torch's flop counter knows (matmuls, convolutions,
    attention), read from the shapes as they run: what ``FlopCounterMode`` counts, without its
    module tracking, whose hooks hold on to module outputs and so would change the very peak
    this step measures (seen: 242 -> 331 MiB for the default run, checkpointing defeated)."""

    _should_skip_dynamo = _no_dynamo_guard

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self._counts: dict[Any, Any] = {}  # op -> its count function (None: no FLOPs)

    def _count(self, func) -> Any:
        from torch.utils.flop_counter import flop_registry

        packet = func._overloadpacket
        count = flop_registry.get(packet)
        if count is None and packet.__name__.endswith("_"):
            # an in-place matmul (a chunked loss accumulates its weight gradient with addmm_):
            # the FLOPs of its functional form, which takes the same arguments
            count = flop_registry.get(getattr(torch.ops.aten, packet.__name__[:-1], None))
        self._counts[func] = count
        return count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self._counts[func] if func in self._counts else self._count(func)
        if count is not None:
            self.total += int(count(*args, **kwargs, out_val=out))
        return out
