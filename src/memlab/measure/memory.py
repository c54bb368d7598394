"""Peak memory by category and by phase.

On every device a categorised live-tensor tracker (torch's MemTracker) records, byte-exact and
repeatably on CPU, which tensors are alive at the peak: parameters, gradients, optimizer state,
activations (saved activations plus backward temporaries, i.e. activation gradients), other
(buffers, inputs). On CUDA the allocator's own peaks (allocated, reserved) are recorded as well
and are the headline number; the tracker's categories then add up to the allocator peak with
the remainder (workspaces, rounding the tracker cannot see) counted as "other".

The tracker slows each step ~3x, so only some steps run under it (``measure.memory_steps``);
the rest are timed for throughput. Because the peak of a step grows with its batch shape,
'auto' tracks the first two steps (optimizer state exists from step 1) and every later step
whose batch shape is the largest so far - enough to catch the peak of the whole run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "other")


def tracker_class():
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import (
        _TOTAL_KEY,
        MemTracker,
        _MemRefType,
        _ModState,
    )

    class Tracker(MemTracker):
        """MemTracker that survives PEFT models (gradient hooks only on parameters that
        require grad; the base class tries every parameter and fails on frozen ones) and a root
        module called twice before ``reset_mod_stats`` (grad accumulation, a KL pass), and that
        leaks nothing from a tracked step.

        The leak: ModTracker puts a multi-grad hook on every module input that requires grad
        and never removes it. When such an input is a leaf (LoRA + checkpointing: the embedding
        output gets ``requires_grad_()`` so checkpointed layers backpropagate), the hook's
        closure holds the leaf's AccumulateGrad node, which holds the leaf: a cycle through C++
        that Python's collector cannot see. Two hidden-state tensors per tracked step stayed
        alive for the whole run (measured: +512 KiB per tracked step on the test model). The
        hooks are recorded while tracking and removed when the step ends."""

        paused = False
        """While True (:meth:`MemoryProbe.untracked`) nothing new is tracked: no allocation,
        no module's parameters or buffers (frees of tracked tensors still count)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.paused:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _skips(self, module) -> bool:
            """A module whose forward ran paused has no stats; its backward hooks can still
            fire later (ModTracker hooks the inputs: a colocated engine's head reads the
            policy's own weight tensors)."""
            return self.paused or (module is not None and module not in self.memory_tracking)

        def _post_fw_hook(self, module, inputs, outputs):
            if not self._skips(module):
                super()._post_fw_hook(module, inputs, outputs)

        def _pre_bw_hook(self, module, args):
            if not self._skips(module):
                super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module, args):
            if not self._skips(module):
                super()._post_bw_hook(module, args)

        entry_fake_mode: object = None
        """The fake-tensor mode active when the tracker was entered (outermost entry): ops
        run under another mode (DTensor's propagation in a fake mode) are not tracked. Kept
        here because torch 2.13's MemTracker records it (``_fake_mode_on_entry``) and earlier
        ones, which memlab supports, do not (torch 2.11 on a GPU machine: every estimate
        failed on the missing attribute)."""
        _entries = 0

        def __enter__(self):
            from torch._guards import active_fake_mode

            from memlab.measure.patches import recording_multi_grad_hooks

            if self._entries == 0:
                self.entry_fake_mode = active_fake_mode()
            self._entries += 1
            self._hook_recording = contextlib.ExitStack()
            self._grad_hook_handles = self._hook_recording.enter_context(
                recording_multi_grad_hooks())
            try:
                return super().__enter__()
            except BaseException:
                self._entries -= 1
                self._hook_recording.close()
                raise

        def __exit__(self, *args):
            self._entries -= 1
            try:
                super().__exit__(*args)
            finally:
                self._hook_recording.close()
                for handle in self._grad_hook_handles:
                    handle.remove()
                self._grad_hook_handles = []

        def phase_begins(self, step: int, name: str, training: bool, device) -> None:
            """Probe phase ``name`` of step ``step`` starts on ``device`` (its peak restarts
            from the current memory): a tracker that keeps more than the phase's peak (an
            estimate's memory after every op: :mod:`memlab.estimate.layers`) starts it."""

        def phase_ends(self) -> None:
            """The probe phase that :meth:`phase_begins` started has ended."""

        def _update_peak_stats(self, peak_state) -> None:
            # Only the global peak (what MemoryProbe reads, by category). MemTracker also keeps
            # a per-module peak, walking every tracked module after every op: 2/3 of the time
            # of a 1B estimate and most of a tracked training step's, and memlab never reads it.
            for dev, snap in self._curr_mem_snap.items():
                total = snap[_TOTAL_KEY]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)

        def _pre_fw_hook(self, module, inputs):
            if self.paused:
                return
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                # Same bookkeeping as for a submodule reused within one iteration.
                stats = self.memory_tracking[module]
                stats.input_mem = self._track_inputs_or_outputs(inputs)
                snap = self.get_tracker_snapshot()
                stats.local_peak = {d: v["Total"] for d, v in snap.items()}
                stats.snapshots.setdefault(_ModState.PEAK_FW, []).append(snap)
                stats.snapshots.setdefault(_ModState.PRE_FW, []).append(deepcopy(snap))

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            param_memory = 0
            for param in module.parameters():
                winfos = self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
                param_memory += sum(w.mem_consumed for w in winfos)
                if param.grad is not None:
                    self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)
                if (
                    install_grad_hooks
                    and param.requires_grad
                    and self._param_to_grad_hook_handles.get(param, None) is None
                ):
                    def hook(grad, self=self):
                        if grad is not None:  # an in-backward step freed it already
                            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(hook),
                        param.register_post_accumulate_grad_hook(lambda p: hook(p.grad)),
                    )
                for t in quantization_state(param):
                    winfos = self._update_and_maybe_create_winfos(t, _MemRefType.PARAM)
                    param_memory += sum(w.mem_consumed for w in winfos)
            buffer_memory = 0
            for buf in module.buffers():
                winfos = self._update_and_maybe_create_winfos(buf, _MemRefType.BUFFER)
                buffer_memory += sum(w.mem_consumed for w in winfos)
            return param_memory, buffer_memory

    from memlab.measure.patches import check_overrides

    check_overrides(MemTracker, Tracker, own=("_skips",))
    return Tracker


def quantization_state(param: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a quantized parameter keeps beside its data, which count as parameters:
    bitsandbytes' 4-bit ``quant_state`` (the per-block scales, the code book and, with double
    quantization, the scales' own scales and code book) and its 8-bit row scales (``SCB``).
    Empty for any other parameter."""
    out: list[torch.Tensor] = []
    state = getattr(param, "quant_state", None)
    while state is not None:
        out += [t for t in (state.absmax, state.code, state.offset)
                if isinstance(t, torch.Tensor)]
        state = state.state2
    scb = getattr(param, "SCB", None)
    if isinstance(scb, torch.Tensor):
        out.append(scb)
    return out


def categorize(raw: dict[Any, int]) -> dict[str, int]:
    """Map MemTracker's reference types onto memlab's five categories."""
    get = {str(getattr(k, "value", k)): int(v) for k, v in raw.items()}
    return {
        "parameters": get.get("Parameter", 0),
        "gradients": get.get("Gradient", 0),
        "optimizer": get.get("Optstate", 0),
        "activations": get.get("Activation", 0) + get.get("Temp", 0),
        "other": get.get("Buffer", 0) + get.get("Other", 0),
    }


class MemoryProbe:
    """Wraps training steps; ``phase()`` wraps forward / backward / optimizer inside a step."""

    def __init__(self, device: str, enabled: bool = True, tracker: Any = None):
        self.device = torch.device(device)
        self.enabled = enabled
        self.is_cuda = self.device.type == "cuda"
        self.tracker = (tracker or tracker_class()()) if enabled else None
        self._active = False
        self._external: list[Any] = []
        self.roles: Any = None
        """Optional ``() -> {category: [tensors]}``: buffers a wrapper owns (DeepSpeed's
        partitions), categorised at the start of every tracked step and phase."""
        self.peak = 0
        self.peak_snap: dict[str, int] = {}
        self.peak_where: tuple[int, str] | None = None
        self.phase_peak: dict[str, int] = {}
        self.phase_snap: dict[str, dict[str, int]] = {}
        self.cuda_peak_alloc = 0
        self.cuda_peak_reserved = 0
        self.cuda_phase_peak: dict[str, int] = {}
        self.tracked_steps: list[int] = []
        self.step_peaks: dict[int, int] = {}
        """Peak of each tracked step (the tracker's on CPU, the allocator's on CUDA)."""
        self._step = -1
        self._training = True
        self.last_phase_peak = 0
        """The tracker's peak in the last phase that ran tracked."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def watch(self, *objs: nn.Module | torch.optim.Optimizer | torch.Tensor | None) -> None:
        """Modules / optimizers / tensors created outside the probe that it must count."""
        self._external.extend(o for o in objs if o is not None)

    # -------------------------------------------------------------- steps
    @contextlib.contextmanager
    def step(self, index: int, tracked: bool, inputs: Sequence[torch.Tensor] = (),
             training: bool = True) -> Iterator[None]:
        """One optimizer step; ``tracked`` runs it under the categorised tracker.
        ``training=False``: an evaluation micro-batch after ``index`` steps (its ``eval``
        phase counts in the peaks; it is not a tracked step)."""
        self._step = index
        self._training = training
        tracker = self.tracker if tracked else None
        if tracker is not None and training:
            self.tracked_steps.append(index)
        if tracker is not None:
            tracker.track_external(*self._external, *inputs)
            self._apply_roles()
            tracker.__enter__()
            self._active = True
        try:
            yield
        finally:
            if tracker is not None:
                self._active = False
                tracker.reset_mod_stats()
                tracker.__exit__(None, None, None)

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Inside, allocations are not the trainer's: a colocated generation engine's own work
        (its weights reload, its decoding), reported by the engine's own accounting instead.
        The phase's peak so far is kept."""
        t = self.tracker if self._active else None
        if t is None or t.paused:
            yield
            return
        t.paused = True
        try:
            yield
        finally:
            t.paused = False

    def _apply_roles(self) -> None:
        if self.roles is None or self.tracker is None:
            return
        from torch.distributed._tools.mem_tracker import _MemRefType

        kind = {"parameters": _MemRefType.PARAM, "gradients": _MemRefType.GRAD,
                "optimizer": _MemRefType.OPT, "other": _MemRefType.OTH}
        for role, tensors in self.roles().items():
            for t in tensors:
                if t.untyped_storage().nbytes():
                    self.tracker._update_and_maybe_create_winfos(t, kind[role])

    def micro_end(self) -> None:
        """After each micro-batch's backward: module stats are per iteration."""
        if self._active and self.tracker is not None:
            self.tracker.reset_mod_stats()

    @contextlib.contextmanager
    def phase(self, name: str):
        """forward / backward / optimizer: records the peak reached inside this phase."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            base_alloc = torch.cuda.max_memory_allocated(self.device)
            base_res = torch.cuda.max_memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t = self.tracker if self._active else None
        dev = self.device
        if t is not None:
            self._apply_roles()
            cur = t.get_tracker_snapshot("current").get(dev, {})
            t._peak_mem[dev] = int(cur.get("Total", 0))
            t._peak_mem_snap[dev] = dict(cur)
            t.phase_begins(self._step, name, self._training, dev)
        try:
            yield
        finally:
            if t is not None:
                t.phase_ends()
                p = int(t._peak_mem.get(dev, 0))
                snap = categorize(
                    {k: v for k, v in t._peak_mem_snap.get(dev, {}).items() if k != "Total"}
                )
                self.record_phase(name, p, snap)
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
                a = torch.cuda.max_memory_allocated(self.device)
                r = torch.cuda.max_memory_reserved(self.device)
                self.cuda_phase_peak[name] = max(self.cuda_phase_peak.get(name, 0), a)
                self.cuda_peak_alloc = max(self.cuda_peak_alloc, a, base_alloc)
                self.cuda_peak_reserved = max(self.cuda_peak_reserved, r, base_res)
                if t is not None:
                    p = a
            if t is not None:
                self._book_step_peak(p)

    def _book_step_peak(self, peak: int) -> None:
        if self._training:
            self.step_peaks[self._step] = max(self.step_peaks.get(self._step, 0), peak)

    def record_phase(self, name: str, peak: int, snap: dict[str, int]) -> None:
        """The tracker's ``peak`` of phase ``name`` (its categories ``snap``) just measured in
        the current step: the phase's and the run's peaks follow."""
        self.last_phase_peak = peak
        if peak > self.phase_peak.get(name, -1):
            self.phase_peak[name] = peak
            self.phase_snap[name] = snap
        if peak > self.peak:
            self.peak, self.peak_snap = peak, snap
            self.peak_where = (self._step, name)

    def replay_phase(self, step: int, name: str, training: bool, peak: int,
                     snap: dict[str, int]) -> None:
        """Book phase ``name`` of ``step`` measured elsewhere (an estimate extended to a
        model's depth: :mod:`memlab.estimate.layers`) as :meth:`phase` books a tracker's."""
        self._step, self._training = step, training
        self.record_phase(name, peak, snap)
        self._book_step_peak(peak)

    def step_metrics(self, index: int) -> dict[str, int]:
        """Per-step metrics of step ``index`` for the logger: ``memory/step_peak_bytes`` when
        the step ran under the tracker, else nothing."""
        if index not in self.step_peaks:
            return {}
        return {"memory/step_peak_bytes": self.step_peaks[index]}

    # -------------------------------------------------------------- result
    def result(self) -> dict[str, Any]:
        """The ``memory`` section of summary.json."""
        by_cat = dict(self.peak_snap) if self.peak_snap else dict.fromkeys(CATEGORIES, 0)
        if self.is_cuda:
            peak = self.cuda_peak_alloc
            by_cat["other"] += max(0, peak - sum(by_cat.values()))
            by_phase = dict(self.cuda_phase_peak)
            source = "cuda_allocator"
            cuda = {
                "peak_allocated_bytes": self.cuda_peak_alloc,
                "peak_reserved_bytes": self.cuda_peak_reserved,
                "tracker_peak_bytes": self.peak,
            }
        else:
            peak = self.peak
            by_phase = dict(self.phase_peak)
            source = "tracker"
            cuda = None
        return {
            "device": str(self.device),
            "source": source,
            "peak_bytes": int(peak),
            "by_category": {k: int(by_cat.get(k, 0)) for k in CATEGORIES},
            "by_phase": {k: int(by_phase.get(k, 0)) for k in
                         (("generate",) if "generate" in by_phase else ())
                         + ("forward", "backward", "optimizer")
                         + (("eval",) if "eval" in by_phase else ())},
            "by_phase_category": self.phase_snap,
            "peak_at": {"step": self.peak_where[0], "phase": self.peak_where[1]}
            if self.peak_where
            else None,
            "tracked_steps": self.tracked_steps,
            "tracked_step_peaks": [self.step_peaks.get(s, 0) for s in self.tracked_steps],
            "cuda": cuda,
        }


def is_oom(exc: BaseException) -> bool:
    """CUDA / CPU out-of-memory errors, whatever their class."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in msg or isinstance(exc, MemoryError) or "can't allocate memory" in msg
    )
