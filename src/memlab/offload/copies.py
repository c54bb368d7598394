"""Moving offloaded activations to their storage and back, for
:class:`memlab.offload.hooks.ActivationOffloader` (which decides what is offloaded).

Synchronous copies
    Without streams (the CPU, or ``use_streams=False``) every copy runs on the current stream:
    the storage copies the tensor out at pack time and back at unpack time.

Streams (CUDA, ``use_streams=True``)
    Device-to-host copies run on a side stream that first waits for the compute stream, so they
    overlap the rest of the forward pass. The source tensor is kept alive until its copy's event
    has completed (polled at every pack). At most ``max_inflight`` copies may be outstanding:
    beyond that the compute stream waits for the oldest copy (a device-side wait, the host does
    not block) and its source is released, so device memory stays bounded when compute outpaces
    the host link; when the offloader's block ends the compute stream waits for the last copy
    and all remaining sources are released. In backward, when a tensor is unpacked the next
    ``prefetch`` offloaded tensors (in reverse forward order) are copied back on a second side
    stream; the compute stream waits on that copy's event before use and the reloaded tensor is
    ``record_stream``-ed on the compute stream.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from memlab.offload.storage import OffloadStorage


class Entry:
    """One offloaded tensor: owns the storage handle; shared by every save of that tensor.

    Lives exactly as long as the packed objects autograd holds; its ``__del__`` returns its bytes
    to the offloader's ``host_bytes`` counter.
    """

    __slots__ = (
        "__weakref__", "handle", "device", "nbytes", "seq", "ready", "prefetched", "reloaded",
        "_release",
    )

    def __init__(self, handle: Any, device: torch.device, nbytes: int, seq: int,
                 release: Any) -> None:
        self.handle = handle
        self.device = device
        self.nbytes = nbytes
        self.seq = seq
        self.ready: Any = None  # CUDA event: device-to-host copy finished
        self.prefetched: tuple[Tensor, Any] | None = None  # (device tensor, CUDA event)
        self.reloaded: weakref.ref[Tensor] | None = None
        self._release = release

    def __del__(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            with contextlib.suppress(Exception):  # interpreter shutdown
                release(self.nbytes)


class Copies:
    """The copies of one offloader: out to ``storage`` at pack time, back at unpack time (on
    CUDA side streams with ``use_streams``: the module docstring). ``order`` lists the entries
    of the step in forward order (weakly), for prefetching in backward."""

    def __init__(self, storage: OffloadStorage, *, use_streams: bool, prefetch: int,
                 max_inflight: int, on_prefetch: Callable[[], None]) -> None:
        self.storage = storage
        self.use_streams = use_streams
        self.prefetch = prefetch
        self.max_inflight = max_inflight
        self._on_prefetch = on_prefetch
        self.order: list[weakref.ref[Entry]] = []
        self._pending: deque[tuple[Any, Tensor, torch.device]] = deque()
        self._streams: dict[tuple[str, int], Any] = {}

    def offload(self, src: Tensor, nbytes: int, release: Callable[[int], None]) -> Entry:
        """Copy ``src`` out; the entry owns the copy and calls ``release(nbytes)`` when it
        goes."""
        event = None
        if self._streams_for(src.device):
            self._drain_pending()
            compute = torch.cuda.current_stream(src.device)
            side = self._side_stream(src.device, "d2h")
            side.wait_stream(compute)  # src must be fully written before it is copied
            with torch.cuda.stream(side):
                handle = self.storage.offload(src)
                event = torch.cuda.Event()
                event.record(side)
            # keep src (its storage) alive until the copy has finished; bound what is in flight
            self._pending.append((event, src, src.device))
            while len(self._pending) > self.max_inflight:
                old_event, _old, old_device = self._pending.popleft()
                torch.cuda.current_stream(old_device).wait_event(old_event)
        else:
            handle = self.storage.offload(src)
        entry = Entry(handle, src.device, nbytes, len(self.order), release)
        entry.ready = event
        self.order.append(weakref.ref(entry))
        return entry

    def reload(self, entry: Entry) -> Tensor:
        """The tensor of ``entry`` back on its device (prefetching the next ones in backward
        when on streams)."""
        if not self._streams_for(entry.device):
            return self.storage.reload(entry.handle, entry.device)
        compute = torch.cuda.current_stream(entry.device)
        if entry.prefetched is not None:
            t, event = entry.prefetched
            entry.prefetched = None
            compute.wait_event(event)
            t.record_stream(compute)  # allocated on the h2d stream, used on the compute stream
        else:
            if entry.ready is not None:
                compute.wait_event(entry.ready)
            t = self.storage.reload(entry.handle, entry.device)
        self._prefetch_before(entry.seq, entry.device)
        return t

    def release_pending(self, wait: bool) -> None:
        """Release all sources: the compute stream first waits for the outstanding copies."""
        if not self._pending:
            return
        if wait:
            last: dict[torch.device, Any] = {}
            for event, _src, device in self._pending:
                last[device] = event
            for device, event in last.items():
                torch.cuda.current_stream(device).wait_event(event)
        self._pending.clear()

    def forget(self) -> None:
        """Forget the step's order (the entries live on in the graphs that hold them)."""
        self.order.clear()

    def all_dead(self) -> bool:
        """Whether the step's entries are all gone (their graphs were freed)."""
        return bool(self.order) and all(r() is None for r in self.order)

    def _streams_for(self, device: torch.device) -> bool:
        return self.use_streams and device.type == "cuda"

    def _side_stream(self, device: torch.device, kind: str) -> Any:
        key = (kind, device.index if device.index is not None else torch.cuda.current_device())
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.Stream(device=device)
        return stream

    def _drain_pending(self) -> None:
        """Drop sources whose device-to-host copy has finished (events complete in order)."""
        while self._pending and self._pending[0][0].query():
            self._pending.popleft()

    def _prefetch_before(self, seq: int, device: torch.device) -> None:
        """Start reloading the ``prefetch`` entries saved just before ``seq`` (next in backward)."""
        if self.prefetch == 0:
            return
        h2d = None
        for j in range(seq - 1, max(-1, seq - 1 - self.prefetch), -1):
            if j >= len(self.order):
                continue
            entry = self.order[j]()
            if entry is None or entry.prefetched is not None or entry.device != device:
                continue
            if entry.reloaded is not None and entry.reloaded() is not None:
                continue
            if h2d is None:
                h2d = self._side_stream(device, "h2d")
            if entry.ready is not None:
                h2d.wait_event(entry.ready)
            with torch.cuda.stream(h2d):
                t = self.storage.reload(entry.handle, entry.device)
                event = torch.cuda.Event()
                event.record(h2d)
            entry.prefetched = (t, event)
            self._on_prefetch()
