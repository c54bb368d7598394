"""`distributed=ddp`: DistributedDataParallel over N processes on this machine, one per device
(GPUs with NCCL, or CPU processes with gloo). ``python -m memlab distributed=ddp`` starts the
ranks itself (``memlab.distributed.launch``): each rank builds the same model and data, trains on
its slice of every global batch of ``train.batch_size * nproc`` rows, and the run's summary
merges what every rank measured.

What it costs in memory, per rank: a full replica of parameters, gradients and optimizer state
(nothing is sharded), plus DDP's gradient buckets (``bucket_cap_mb``; with
``gradient_as_bucket_view`` the gradients live inside the buckets instead of beside them).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memlab.distributed.base import Ranks, Sharding, register
from memlab.registry import PositiveFloat
from memlab.trainer.routing import Routed

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("ddp")
@dataclass(kw_only=True)
class DDP(Ranks):
    """Data parallel: every rank a full replica, gradients all-reduced in backward."""

    bucket_cap_mb: PositiveFloat = 25.0
    """Gradient bucket size: larger buckets, fewer all-reduce calls, more memory in flight."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into the buckets (saves one gradient-sized copy)."""
    find_unused_parameters: bool = False
    """Needed only when some trainable parameter gets no gradient in a step."""
    static_graph: bool = False
    """DDP's static_graph: the set of used parameters and the graph are the same every step,
    which lets DDP skip its per-step search (and take checkpointed models with
    find_unused_parameters)."""
    sync_buffers: bool = False
    """Re-send rank 0's buffers before every forward (DDP's ``broadcast_buffers``). Needed for
    running statistics (batch norm); a causal LM's buffers (rotary frequencies) are constant
    and identical on every rank, so the default skips the per-step broadcast."""
    def wrap(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        kwargs: dict[str, Any] = dict(bucket_cap_mb=self.bucket_cap_mb,
                                      gradient_as_bucket_view=self.gradient_as_bucket_view,
                                      find_unused_parameters=self.find_unused_parameters,
                                      static_graph=self.static_graph)
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        kwargs["forward_sync_buffers" if "forward_sync_buffers" in params
               else "broadcast_buffers"] = self.sync_buffers
        if ctx.is_cuda:
            kwargs["device_ids"] = [torch.cuda.current_device()]
        return DistributedDataParallel(Routed(model), **kwargs)

    def sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """All-reduce gradients only in the step's last micro-batch."""
        from torch.nn.parallel import DistributedDataParallel

        if last or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def describe(self, model: nn.Module) -> dict[str, Any]:
        """DDP's own buffers, for the summary: its gradient buckets are allocated when the model
        is wrapped (before the memory tracker starts) and stay for the whole run, so the
        tracker sees them only as gradients while those exist; on CUDA the allocator's peak
        includes them."""
        from torch.nn.parallel import DistributedDataParallel

        data = (model._get_ddp_logging_data() if isinstance(model, DistributedDataParallel)
                else {})
        sizes = [int(x) for x in str(data.get("bucket_sizes", "")).split(",") if x.strip()]
        return {"bucket_bytes": sum(sizes), "buckets": len(sizes),
                "gradient_as_bucket_view": self.gradient_as_bucket_view}

    def sharding(self) -> Sharding | None:
        """A full replica per rank, plus DDP's resident gradient buckets."""
        return Sharding(zero_stage=0, gradient_as_bucket_view=self.gradient_as_bucket_view)
