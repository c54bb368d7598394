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
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
from torch import nn

from memlab.distributed.base import Routed
from memlab.registry import register


def env_rank() -> tuple[int, int, int]:
    """(rank, local rank, world size) of this worker, from the launcher's environment."""
    return (int(os.environ.get("MEMLAB_RANK", 0)), int(os.environ.get("MEMLAB_LOCAL_RANK", 0)),
            int(os.environ.get("MEMLAB_WORLD_SIZE", 1)))


@register("distributed", "ddp")
@dataclass(kw_only=True)
class DDP:
    """Data parallel: every rank a full replica, gradients all-reduced in backward."""

    nproc: int | None = None
    """Ranks on this machine. None: one per visible GPU on CUDA, 2 on CPU."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on CUDA, gloo on CPU."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size: larger buckets, fewer all-reduce calls, more memory in flight."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into the buckets (saves one gradient-sized copy)."""
    find_unused_parameters: bool = False
    """Needed only when some trainable parameter gets no gradient in a step."""
    static_graph: bool = False
    sync_buffers: bool = False
    """Re-send rank 0's buffers before every forward (DDP's ``broadcast_buffers``). Needed for
    running statistics (batch norm); a causal LM's buffers (rotary frequencies) are constant
    and identical on every rank, so the default skips the per-step broadcast."""
    timeout_s: int = 1800
    """How long a rank waits in a collective before the run fails (a dead peer)."""
    master_port: int = 0
    """Rendezvous port on 127.0.0.1; 0 picks a free one."""

    def processes(self, device: str) -> int:
        if self.nproc is not None:
            return self.nproc
        if device.startswith("cuda") and torch.cuda.is_available():
            return max(1, torch.cuda.device_count())
        return 2

    def backend_for(self, device: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.startswith("cuda") else "gloo"

    def validate(self, ctx) -> list[str]:
        errors = []
        n = self.processes(ctx.device)
        if n < 1:
            errors.append(f"distributed.nproc must be >= 1 (got {n})")
        if ctx.is_cuda and torch.cuda.is_available() and n > torch.cuda.device_count():
            errors.append(f"distributed.nproc={n} but {torch.cuda.device_count()} CUDA "
                          f"device(s) are visible; set distributed.nproc<="
                          f"{torch.cuda.device_count()} (one rank per GPU)")
        if self.backend_for(ctx.device) == "nccl" and not ctx.is_cuda:
            errors.append("distributed.backend=nccl needs CUDA devices; use "
                          "distributed.backend=gloo (or auto) on CPU")
        if not torch.distributed.is_available():
            errors.append("this torch build has no torch.distributed; use distributed=single")
        return errors

    def setup(self, ctx) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            return
        _, local, _ = env_rank()
        if ctx.is_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(self.backend_for(ctx.device), rank=ctx.rank,
                                world_size=ctx.world_size,
                                timeout=timedelta(seconds=self.timeout_s))

    def teardown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def wrap(self, model: nn.Module, ctx) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        kwargs = dict(bucket_cap_mb=self.bucket_cap_mb,
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
        if last or not hasattr(model, "no_sync"):
            return contextlib.nullcontext()
        return model.no_sync()

    def all_reduce_sum(self, values: list[float], device: str) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64,
                         device=device if self.backend_for(device) == "nccl" else "cpu")
        dist.all_reduce(t)
        return t.tolist()

    def describe(self, model: nn.Module) -> dict:
        """DDP's own buffers, for the summary: its gradient buckets are allocated when the model
        is wrapped (before the memory tracker starts) and stay for the whole run, so the
        tracker sees them only as gradients while those exist; on CUDA the allocator's peak
        includes them."""
        data = model._get_ddp_logging_data() if hasattr(model, "_get_ddp_logging_data") else {}
        sizes = [int(x) for x in str(data.get("bucket_sizes", "")).split(",") if x.strip()]
        return {"bucket_bytes": sum(sizes), "buckets": len(sizes),
                "gradient_as_bucket_view": self.gradient_as_bucket_view}

    def shards_states(self) -> bool:
        return False
