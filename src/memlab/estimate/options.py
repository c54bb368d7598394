"""What ``memlab estimate`` is asked (:class:`EstimateOptions`), the cards it knows, sizes,
and the verdict against a budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from memlab.measure.summary import parse_bytes  # noqa: F401 (re-exported: sizes as users write them)

GiB = 1024**3
MiB = 1024**2
PHASES = ("forward", "backward", "optimizer")
ALL_PHASES = ("generate", *PHASES, "eval")  # generate: online methods only; eval: with data.eval

CUDA_BLOCK = 512
"""The CUDA caching allocator rounds every allocation up to a multiple of 512 bytes."""

CARDS: dict[str, dict[str, Any]] = {
    # total memory as nvidia-smi reports it (MiB), compute capability major version, dense
    # 16-bit tensor-core TFLOP/s with fp32 accumulation (spec sheets), host link GB/s (PCIe,
    # one direction, what a copy reaches: ~80% of the link)
    "t4": {"name": "NVIDIA T4 16GB", "mib": 15360, "sm": 7, "tflops": 65, "host_gbs": 12},
    "a10g": {"name": "NVIDIA A10G 24GB", "mib": 23028, "sm": 8, "tflops": 70, "host_gbs": 25},
    "l4": {"name": "NVIDIA L4 24GB", "mib": 23034, "sm": 8, "tflops": 121, "host_gbs": 25},
    "rtx4090": {"name": "NVIDIA GeForce RTX 4090 24GB", "mib": 24564, "sm": 8, "tflops": 82.6,
                "host_gbs": 25},
    "a100-40gb": {"name": "NVIDIA A100 40GB", "mib": 40960, "sm": 8, "tflops": 312,
                  "host_gbs": 25},
    "a100-80gb": {"name": "NVIDIA A100 80GB", "mib": 81920, "sm": 8, "tflops": 312,
                  "host_gbs": 25},
    "h100-80gb": {"name": "NVIDIA H100 80GB", "mib": 81559, "sm": 9, "tflops": 989,
                  "host_gbs": 50},
    "h200": {"name": "NVIDIA H200 141GB", "mib": 143771, "sm": 9, "tflops": 989,
             "host_gbs": 50},
}
"""Cards ``--card`` knows: usable memory as ``nvidia-smi`` shows it; the compute and host-link
rates are what ``memlab fit``'s speed model divides by."""

CUDA_CONTEXT_BYTES = 512 * MiB
"""CUDA context + loaded kernels, outside PyTorch's allocator (varies 0.3-0.6 GiB with driver,
architecture and libraries). Counted in the verdict, not in the allocator peak."""


CUBLAS_HANDLES = 2
"""The cuBLAS workspaces a training step holds. torch gives each thread its own cuBLAS handle
and each (handle, stream) its own workspace from the caching allocator; the forward's matmuls
run on the caller's thread, the backward's on autograd's device thread. Measured on an H200
(torch 2.11, CUDA 13, benchmarks/gpu_acceptance.py's run): +32 MiB at the first matmul, +32
MiB more at the first backward, nothing after."""


def cublas_workspace_bytes(sm_major: int = 8, handles: int = CUBLAS_HANDLES) -> int:
    """torch's default cuBLAS workspaces: ``:4096:8`` (32 MiB) each on Hopper, else
    ``:4096:2:16:8`` (8.125 MiB), times ``handles``."""
    one = 4096 * 1024 * 8 if sm_major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8
    return one * handles


def local_sm_major(default: int = 8) -> int:
    """The major compute capability of this machine's first GPU; ``default`` without one (an
    estimate for a CUDA machine made elsewhere, without ``--card``)."""
    import torch

    return torch.cuda.get_device_capability(0)[0] if torch.cuda.is_available() else default


class EstimateError(RuntimeError):
    """The configuration cannot be estimated (the message says why and what to do)."""


Device = Literal["cpu", "cuda"]
ZeroStage = Literal[0, 1, 2, 3]


def device_of(requested: str | None, card: str | None) -> Device:
    """The device to estimate for: ``--device``, else cuda with a ``--card``, else cpu."""
    if requested is None:
        return "cuda" if card else "cpu"
    if requested == "cuda":
        return "cuda"
    if requested == "cpu":
        return "cpu"
    raise EstimateError(f"device {requested!r}: choose cpu or cuda")


def zero_stage(stage: int) -> ZeroStage:
    """``stage`` as a ZeRO stage (0-3)."""
    for s in (0, 1, 2, 3):
        if stage == s:
            return s
    raise EstimateError(f"ZeRO stage {stage}: choose 0, 1, 2 or 3")


@dataclass(kw_only=True)
class EstimateOptions:
    """How to estimate (everything else comes from the composed configuration)."""

    device: Device = "cpu"
    """cpu: the tracker's byte-exact CPU peak; cuda: the CUDA model described in the module
    docstring (validated as a CUDA run)."""
    card: str | None = None
    """A key of :data:`CARDS` (sets the budget and the cuBLAS workspace size)."""
    budget_bytes: int | None = None
    """Memory available per device; None = the card's, or no verdict."""
    world_size: int = 1
    zero_stage: ZeroStage = 0
    """ZeRO stage (3 = FSDP full shard) applied to the categories when world_size > 1."""
    length: int | None = None
    """Tokens per row of the worst-case batches; None = method.max_length."""
    from_data: bool = False
    """Measure the run's own micro-batches (its batch stream over the prepared real data, every
    micro-batch of its steps) instead of the worst-case batches the settings allow."""
    docs_per_row: int | None = None
    """Documents per packed row (position_ids restart at each); None = the larger of 1 and 2
    (see :mod:`memlab.estimate.batch`)."""
    exact_masks: bool = True
    """Answer transformers' value-dependent mask decisions from the real batch (see
    :mod:`memlab.estimate.fake`); False keeps its fake-tensor (tracing) behaviour."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """HF config fields to change (``hidden_size``, ``num_hidden_layers``, ...)."""
    count_flops: bool = False
    """Count the floating-point operations of the measured step(s) (torch's
    ``FlopCounterMode`` over the fake step: matmuls and attention, the recomputation that
    checkpointing adds included) into ``flops`` (``memlab fit``'s speed model)."""
    every_layer: bool = False
    """Build and measure every decoder layer, not two shallow builds extended to the model's
    depth (:mod:`memlab.estimate.layers`: the same estimate, the reference it is tested
    against)."""
    run_first_step: bool = False
    """Run (and track) step 0 as well. Default: the optimizer state is created by the
    optimizer's own ``step`` on fake zero gradients, then only the steady-state step 1 runs
    (half the time; step 0 never peaks higher: it has no optimizer state in forward/backward
    and the same gradients + state + temporaries in its optimizer phase as step 1)."""


# ----------------------------------------------------------------------------- configuration


def verdict(peak: int, budget: int | None, by_category: dict[str, int],
            overhead: int = 0) -> dict[str, Any] | None:
    """Fits / does not fit ``budget`` with ``peak + overhead`` (CUDA context on a card)."""
    if budget is None:
        return None
    need = peak + overhead
    top = max(by_category, key=by_category.__getitem__) if by_category else "?"
    fits = need <= budget
    if fits:
        text = f"fits with {fmt_bytes(budget - need)} headroom"
    else:
        text = (f"does not fit: over by {fmt_bytes(need - budget)}; dominated by {top} "
                f"({fmt_bytes(by_category.get(top, 0))})")
    return {"fits": fits, "budget_bytes": int(budget), "needed_bytes": int(need),
            "overhead_bytes": int(overhead), "headroom_bytes": int(budget - need),
            "dominant": top, "text": text}


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= GiB:
        return f"{sign}{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{sign}{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{sign}{n / 1024:.1f} KiB"
    return f"{sign}{int(n)} B"
