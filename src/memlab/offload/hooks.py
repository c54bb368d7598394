"""Activation offloading through ``torch.autograd.graph.saved_tensors_hooks``.

Every tensor that autograd saves for backward during the forward pass goes through
:meth:`ActivationOffloader.pack`; the returned object is what autograd keeps in the graph. Big
floating activations are copied to a *storage* (host memory by default) and the device copy is
released as soon as nothing else references it; :meth:`ActivationOffloader.unpack` brings them
back when backward needs them.

Ownership (why nothing leaks)
    The host buffer of an offloaded tensor is owned by the packed object that autograd stores in
    the graph, never by the offloader, which keeps only weak references (for de-duplication and
    prefetching). When backward frees the graph (``retain_graph=False``), or when a graph is
    dropped without a backward, the host buffers go with it and :meth:`~ActivationOffloader.stats`
    reports ``host_bytes == 0``. :meth:`~ActivationOffloader.reset` (called by the trainer after
    every micro-batch backward) only clears the offloader's own book-keeping, and waits for
    outstanding copies.

What stays on the device (is *kept*)
    * parameters, buffers and views of them (``exclude=`` storages, plus anything that is or is
      a view of an ``nn.Parameter``);
    * tensors smaller than ``min_bytes``;
    * non-floating tensors (indices, masks) unless ``floating_only=False``;
    * tensors on another device than ``device`` (when given), tensor subclasses and non-strided
      layouts;
    * outputs of modules registered with :meth:`~ActivationOffloader.exclude_outputs_of` (e.g.
      the LM head: its logits are needed again right at the start of backward) and everything
      saved inside :meth:`~ActivationOffloader.disabled` /
      :meth:`~ActivationOffloader.disable_within`.

De-duplication
    The same tensor is often saved by several ops (``x * x``, a residual stream used by two
    projections). Saves of the same storage with the same offset, shape, strides, dtype *and
    version counter* share one host copy; the version counter makes a tensor modified in place
    between two saves count as a different tensor. A view and its base are *not* merged.

Copies
    Moving the bytes (synchronous, or on CUDA side streams overlapping compute, with prefetch in
    backward) is :mod:`memlab.offload.copies`'s job; this module decides what is offloaded and
    keeps the books.

CPU
    On a CPU-only run there is no device memory to save: the default storage copies each
    offloaded tensor into a *separate CPU buffer* and hands that buffer back in backward. This
    exercises the whole code path (selection, de-duplication, ownership, counters) so it can be
    tested without a GPU, but it saves **no** memory (transiently it uses more). ``pin_memory``
    and ``use_streams`` are ignored for tensors that are not on CUDA.

Gradient checkpointing
    Saved-tensor hooks nest and only the innermost pair applies. Non-reentrant
    ``torch.utils.checkpoint`` (what ``gradient_checkpointing_enable(use_reentrant=False)`` uses
    in transformers) pushes its own hooks inside each checkpointed region, so inside it the
    offloader sees nothing; it does see the checkpoint *inputs* (saved outside the region by
    checkpoint's ``_NoopSaveInputs``) and what is saved outside checkpointed layers (embeddings,
    final norm, LM head, loss). In backward the recomputation runs under checkpoint's own hooks,
    so recomputed activations stay on the device. Gradients are unchanged. Reentrant
    checkpointing runs the region under ``no_grad`` and saves its inputs through the outer hooks,
    which also works but is not what memlab uses.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from memlab.offload.copies import Copies, Entry
from memlab.offload.storage import HostStorage, OffloadStorage, storage_key

__all__ = ["ActivationOffloader", "HostStorage", "OffloadStorage"]

_MiB = 1 << 20
_KEEP_REASONS = ("small", "param", "non_float", "excluded", "disabled", "other_device",
                 "unsupported")


class _Packed:
    """What autograd stores for an offloaded tensor (one per save, several may share an entry)."""

    __slots__ = ("entry",)

    def __init__(self, entry: Entry) -> None:
        self.entry = entry


class ActivationOffloader:
    """Context manager that offloads activations saved for backward (see the module docstring).

    Use it around the forward pass (including the loss), then run backward outside it::

        offloader = ActivationOffloader.for_model(model, min_bytes=1 << 20)
        offloader.exclude_outputs_of(model.lm_head)
        for batch in loader:
            with offloader:
                loss = model(**batch).loss
            loss.backward()
            offloader.reset()  # once per step, after backward

    Args:
        min_bytes: tensors smaller than this stay where they are (default 1 MiB).
        use_streams: on CUDA, overlap device-to-host copies with compute on a side stream and
            prefetch reloads for backward on another; ``False``: synchronous copies.
        pin_memory: pinned host buffers for CUDA tensors (default storage only).
        storage: an :class:`OffloadStorage` (``offload(tensor) -> handle``,
            ``reload(handle, device) -> tensor``); default :class:`HostStorage`.
        exclude: tensors never offloaded, matched by storage, so views of them are excluded too
            (pass the model's parameters and buffers; :meth:`for_model` does).
        device: only tensors on this device are offloaded (``None``: any device).
        floating_only: keep non-floating tensors (indices, masks) where they are.
        dedup: share one copy between saves of the same tensor.
        prefetch: how many tensors to reload ahead in backward (streams only).
        max_inflight: how many device-to-host copies may be outstanding before the compute
            stream waits for the oldest (streams only).
        key: ``tensor -> hashable``, which storage a tensor views (default :func:`storage_key`:
            device and data pointer; fake tensors, whose storages have no data, need another).
        tensor_types: the tensor classes handled (others, e.g. DTensor or quantized subclasses,
            are kept where they are).
    """

    def __init__(
        self,
        *,
        min_bytes: int = _MiB,
        use_streams: bool = True,
        pin_memory: bool = True,
        storage: OffloadStorage | None = None,
        exclude: Iterable[Tensor] = (),
        device: torch.device | str | None = None,
        floating_only: bool = True,
        dedup: bool = True,
        prefetch: int = 2,
        max_inflight: int = 4,
        key: Any = storage_key,
        tensor_types: tuple[type, ...] = (Tensor, nn.Parameter),
    ) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.min_bytes = int(min_bytes)
        self.use_streams = bool(use_streams)
        self.pin_memory = bool(pin_memory)
        self.storage: OffloadStorage = (
            storage if storage is not None
            else HostStorage(pin_memory=pin_memory, non_blocking=use_streams)
        )
        self.device = torch.device(device) if device is not None else None
        self.floating_only = floating_only
        self.dedup = dedup
        self._copies = Copies(self.storage, use_streams=self.use_streams, prefetch=int(prefetch),
                              max_inflight=max(1, int(max_inflight)),
                              on_prefetch=lambda: self._count("prefetched_tensors"))
        self._key = key
        self.tensor_types = tensor_types

        self._lock = threading.RLock()  # backward (and entry release) may run on another thread
        self._excluded: dict[tuple[str, int], weakref.ref] = {}
        self.exclude_tensors(exclude)
        self._marked: dict[tuple[str, int], weakref.ref] = {}  # per-step outputs to keep
        self._disabled = 0
        self._hooks: list[Any] = []

        # per-step book-keeping (weak or cleared by reset())
        self._seen: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}

        self._counters: dict[str, int] = {}
        self._host_bytes = 0
        self._peak_host_bytes = 0
        self.reset_stats()

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def for_model(cls, model: nn.Module, **kwargs: Any) -> ActivationOffloader:
        """An offloader that never offloads ``model``'s parameters, buffers or views of them."""
        extra = list(kwargs.pop("exclude", ()))
        tensors = [*model.parameters(), *model.buffers(), *extra]
        return cls(exclude=tensors, **kwargs)

    def exclude_tensors(self, tensors: Iterable[Tensor]) -> None:
        """Never offload these tensors or anything sharing their storage (views)."""
        for t in tensors:
            if isinstance(t, Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                self._excluded[self._key(t)] = weakref.ref(st)

    def exclude_outputs_of(self, module: nn.Module) -> RemovableHandle:
        """Keep the tensors ``module`` returns on the device when they are saved for backward.

        Meant for the LM head: its logits are consumed by the loss and needed at the very start
        of backward, so a round trip to the host only costs time. Only the output tensors
        themselves (and views of them) are covered, not tensors computed from them (e.g. the
        ``log_softmax`` result saved by the loss): wrap the loss in :meth:`disabled` for that.
        """
        def hook(_mod: nn.Module, _args: Any, output: Any) -> None:
            for t in tree_leaves(output):
                if isinstance(t, Tensor) and t.layout == torch.strided:
                    self._marked[self._key(t)] = weakref.ref(t.untyped_storage())

        return module.register_forward_hook(hook)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Nothing saved inside this block is offloaded (nests)."""
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1

    def disable_within(self, module: nn.Module) -> tuple[RemovableHandle, RemovableHandle]:
        """Keep everything saved while ``module``'s forward runs on the device."""
        def pre(_mod: nn.Module, _args: Any) -> None:
            self._disabled += 1

        def post(_mod: nn.Module, _args: Any, _out: Any) -> None:
            self._disabled -= 1

        return (module.register_forward_pre_hook(pre),
                module.register_forward_hook(post, always_call=True))

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> ActivationOffloader:
        if not self._hooks:
            self._forget_dead()
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks = self._hooks.pop()
        hooks.__exit__(*exc)
        if not self._hooks:
            self._copies.release_pending(wait=True)

    # ------------------------------------------------------------------ the hooks
    def _keep_reason(self, t: Tensor) -> str | None:
        """Why ``t`` stays where it is, or ``None`` if it should be offloaded."""
        if self._disabled:
            return "disabled"
        if type(t) not in self.tensor_types:
            return "unsupported"  # tensor subclasses (DTensor, quantized, fake, ...)
        if t.layout != torch.strided or t.device.type == "meta":
            return "unsupported"
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return "param"
        if self.device is not None and not self._on_device(t.device):
            return "other_device"
        if self.floating_only and not (t.is_floating_point() or t.is_complex()):
            return "non_float"
        if t.numel() * t.element_size() < self.min_bytes:
            return "small"
        key = self._key(t)
        ref = self._excluded.get(key)
        if ref is not None and ref() is not None:
            return "param"
        ref = self._marked.get(key)
        if ref is not None and ref() is not None:
            return "excluded"
        return None

    def pack(self, tensor: Tensor) -> Any:
        """Pack hook: a packed handle for an offloaded tensor, or the (detached) tensor itself.

        Kept tensors are returned detached: returning a saved *output* itself would make a
        reference cycle (tensor -> grad_fn -> saved variable -> tensor) that is never freed.
        Autograd restores ``grad_fn`` / ``requires_grad`` when unpacking.
        """
        nbytes = tensor.numel() * tensor.element_size()
        reason = self._keep_reason(tensor)
        if reason is not None:
            self._count("kept_tensors", "kept_bytes", nbytes)
            self._count(f"kept_{reason}")
            return tensor.detach()
        with torch.no_grad():
            src = tensor.detach()
            key: tuple | None = None
            if self.dedup:
                key = (*self._key(src), src.storage_offset(), tuple(src.shape),
                       src.stride(), src.dtype, src._version)
                hit = self._seen.get(key)
                if hit is not None:
                    st_ref, entry_ref = hit
                    entry = entry_ref()
                    if entry is not None and st_ref() is src.untyped_storage():
                        self._count("deduplicated_tensors", "deduplicated_bytes", nbytes)
                        return _Packed(entry)
            entry = self._offload(src, nbytes)
            if key is not None:
                self._seen[key] = (weakref.ref(src.untyped_storage()), weakref.ref(entry))
        self._count("offloaded_tensors", "offloaded_bytes", nbytes)
        return _Packed(entry)

    def unpack(self, packed: Any) -> Tensor:
        """Unpack hook: the saved tensor, reloaded onto its device if it was offloaded."""
        if not isinstance(packed, _Packed):
            return packed
        entry = packed.entry
        if entry.reloaded is not None:
            t = entry.reloaded()
            if t is not None:  # saved twice and the first reload is still alive
                return t
        with torch.no_grad():
            t = self._copies.reload(entry)
        entry.reloaded = weakref.ref(t)
        self._count("reloaded_tensors", "reloaded_bytes", entry.nbytes)
        return t

    def _on_device(self, device: torch.device) -> bool:
        """``device`` matches ``self.device`` (``cuda`` matches every ``cuda:i``)."""
        want = self.device
        assert want is not None
        return device.type == want.type and (want.index is None or device.index == want.index)

    # ------------------------------------------------------------------ copies
    def _offload(self, src: Tensor, nbytes: int) -> Entry:
        entry = self._copies.offload(src, nbytes, self._release_host)
        with self._lock:
            self._host_bytes += nbytes
            self._peak_host_bytes = max(self._peak_host_bytes, self._host_bytes)
        return entry

    # ------------------------------------------------------------------ book-keeping
    def _release_host(self, nbytes: int) -> None:
        with self._lock:
            self._host_bytes -= nbytes

    def _count(self, name: str, bytes_name: str | None = None, nbytes: int = 0) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + 1
            if bytes_name is not None:
                self._counters[bytes_name] = self._counters.get(bytes_name, 0) + nbytes

    def reset(self) -> None:
        """Per-step cleanup; call after each backward (the trainer does, per micro-batch).

        Waits for outstanding device-to-host copies, then forgets the de-duplication table, the
        prefetch order and the per-step output marks. Host buffers still referenced by a live
        graph are *not* freed here: they belong to that graph and go when it goes.
        """
        self._copies.release_pending(wait=True)
        self._seen.clear()
        self._copies.forget()
        self._marked.clear()
        self._excluded = {k: r for k, r in self._excluded.items() if r() is not None}

    def _forget_dead(self) -> None:
        """Drop book-keeping whose tensors are all gone (a cheap safety net besides reset())."""
        if self._copies.all_dead():
            self._copies.forget()
            self._seen.clear()
        self._marked = {k: r for k, r in self._marked.items() if r() is not None}

    def reset_stats(self) -> None:
        """Zero the cumulative counters (``host_bytes`` is live state and is kept)."""
        with self._lock:
            self._counters = dict.fromkeys(
                ("offloaded_tensors", "offloaded_bytes", "deduplicated_tensors",
                 "deduplicated_bytes", "kept_tensors", "kept_bytes", "reloaded_tensors",
                 "reloaded_bytes", "prefetched_tensors",
                 *(f"kept_{r}" for r in _KEEP_REASONS)), 0)
            self._peak_host_bytes = self._host_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes currently held by the storage for live graphs."""
        return self._host_bytes

    def stats(self) -> dict[str, int]:
        """Counters since construction / :meth:`reset_stats`, plus live and peak host bytes.

        ``offloaded_*``: distinct tensors copied out; ``deduplicated_*``: saves served by an
        existing copy; ``kept_*``: saves left in place, with ``kept_<reason>`` counts for
        ``small``, ``param``, ``non_float``, ``excluded``, ``disabled``, ``other_device`` and
        ``unsupported``; ``reloaded_*``: copies back for backward; ``host_bytes`` /
        ``peak_host_bytes``: storage bytes held now / at most.
        """
        with self._lock:
            out = dict(self._counters)
            out["host_bytes"] = self._host_bytes
            out["peak_host_bytes"] = self._peak_host_bytes
        return out
