"""Top-level (non-group) typed configs and the frozen build context shared by every builder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and loop settings (``train:`` in conf/config.yaml)."""

    seed: int = 0
    """Seeds model init, data order and dropout."""
    steps: int = 20
    """Optimizer steps to run (data cycles as needed, reshuffled per epoch)."""
    batch_size: int = 4
    """Rows per micro-batch per device."""
    grad_accum: int = 1
    """Micro-batches per optimizer step. The loss is normalised over the whole step's tokens,
    so 1x8 and 8x1 give the same gradient."""
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    optimizer: Literal["adamw", "sgd"] = "adamw"
    scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    gradient_checkpointing: bool = True
    """Recompute activations in backward (non-reentrant). On by default, as in TRL."""
    checkpoint_every: int = 1
    """Selective checkpointing: checkpoint every k-th decoder layer (1 = all)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    save_every: int = 0
    """Save a resumable checkpoint every N optimizer steps (0 = never)."""
    save_final: bool = False
    resume_from: str | None = None
    """Checkpoint dir to resume from, or 'latest' for the newest under this run dir."""
    progress: bool = True
    """Show a progress bar with live loss and tokens/s."""
    log_every: int = 1


@dataclass(kw_only=True)
class MeasureConfig:
    """What the run measures about itself (``measure:``)."""

    memory: bool = True
    """Categorised live-tensor tracking (torch MemTracker); on CUDA the allocator peak is
    recorded in every case."""
    memory_steps: Literal["auto", "all"] | int = "auto"
    """Steps under the tracker: 'auto' = the first two plus any later step whose batch shape
    is the largest so far (this catches the run's peak while leaving most steps untracked and
    fast), 'all', or the first N."""
    warmup_steps: int = 1
    """Steps excluded from throughput (compilation, allocator warm-up, lazy init)."""
    fail_on_oom: bool = False
    """Re-raise OOM instead of recording it (for debugging)."""


@dataclass(frozen=True)
class BuildContext:
    """Everything a builder may know besides its own config: the other groups' choices, the
    device and the world size. Frozen: builders read it, never change it."""

    method: Any
    packing: Any
    attention: Any
    precision: Any
    offload: Any
    peft: Any
    distributed: Any
    model: Any
    data: Any
    logger: Any
    generation: Any
    train: TrainConfig
    measure: MeasureConfig
    device: str = "cpu"
    world_size: int = 1
    rank: int = 0
    choices: dict[str, str] = field(default_factory=dict)
    run_dir: Path = Path(".")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def groups(self) -> dict[str, Any]:
        """The typed config of every group, by group name."""
        from memlab.registry import GROUPS

        return {g: getattr(self, g) for g in GROUPS}
