"""Where offloaded activations live between forward and backward: the storage protocol, the
default host storage, and how a tensor's storage is identified."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class OffloadStorage(Protocol):
    """Where offloaded activations live between forward and backward.

    ``offload`` gets a detached tensor and returns any handle; ``reload`` turns that handle back
    into a tensor on ``device`` with the same shape, dtype and values. When the offloader uses
    CUDA streams it calls both inside a ``torch.cuda.stream`` context, so copies should be
    enqueued on the current stream (``non_blocking``) rather than synchronising.
    """

    def offload(self, tensor: Tensor) -> Any:
        """Copy ``tensor`` out; the returned handle must own the copy."""
        ...

    def reload(self, handle: Any, device: torch.device) -> Tensor:
        """Return the tensor held by ``handle`` on ``device``."""
        ...


class HostStorage:
    """Default storage: a host (CPU) copy, pinned when the source is on CUDA and ``pin_memory``.

    The host buffer keeps the source's strides when the source is dense (so backward kernels see
    the same layout and gradients stay bit-identical); otherwise it is contiguous. A CPU source is
    copied into a separate CPU buffer (the CPU stand-in: no memory is saved), and reloading to
    the CPU returns that buffer itself without a second copy.
    """

    def __init__(self, pin_memory: bool = True, non_blocking: bool = False) -> None:
        self.pin_memory = pin_memory
        self.non_blocking = non_blocking

    def offload(self, tensor: Tensor) -> Tensor:
        """Copy ``tensor`` into a new host buffer (pinned for CUDA sources if enabled)."""
        pin = self.pin_memory and tensor.is_cuda
        buf = torch.empty_like(tensor, device="cpu", pin_memory=pin)
        buf.copy_(tensor, non_blocking=self.non_blocking and pin)
        return buf

    def reload(self, handle: Tensor, device: torch.device) -> Tensor:
        """The host buffer on ``device`` (the buffer itself when ``device`` is the CPU)."""
        if handle.device == device:
            return handle
        non_blocking = self.non_blocking and handle.is_pinned()
        return handle.to(device, non_blocking=non_blocking)


def storage_key(t: Tensor) -> tuple[str, int]:
    """Which storage ``t`` views: (device, data pointer)."""
    st = t.untyped_storage()
    return (str(st.device), st.data_ptr())
