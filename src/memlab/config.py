"""Top-level (non-group) typed configs and the frozen build context shared by every builder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from memlab import _guards
from memlab.registry import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    Seed,
)


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and loop settings (``train:`` in conf/config.yaml)."""

    seed: Seed = 0
    """Seeds model init, data order and dropout."""
    steps: PositiveInt = 20
    """Optimizer steps to run (data cycles as needed, reshuffled per epoch)."""
    batch_size: PositiveInt = 4
    """Rows per micro-batch per device."""
    grad_accum: PositiveInt = 1
    """Micro-batches per optimizer step. The loss is normalised over the whole step's tokens,
    so 1x8 and 8x1 give the same gradient."""
    lr: PositiveFloat = 3e-4
    weight_decay: NonNegativeFloat = 0.0
    betas: list[Annotated[float, Range(ge=0, lt=1)]] = field(
        default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2), each in [0, 1)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    """Steps of linear learning-rate warm-up."""
    max_grad_norm: PositiveFloat | None = 1.0
    """Clip the gradient norm to this (null: no clipping)."""
    gradient_checkpointing: bool = True
    """Recompute activations in backward (non-reentrant). On by default, as in TRL."""
    checkpoint_every: PositiveInt = 1
    """Selective checkpointing: checkpoint every k-th decoder layer (1 = all)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    save_every: NonNegativeInt = 0
    """Save a resumable checkpoint every N optimizer steps (0 = never)."""
    save_final: bool = False
    resume_from: str | None = None
    """Checkpoint dir to resume from, or 'latest' for the newest under this run dir."""
    progress: bool = True
    """Show a progress bar with live loss and tokens/s."""
    log_every: PositiveInt = 1
    """Send metrics to the logger every N optimizer steps."""


@dataclass(kw_only=True)
class MeasureConfig:
    """What the run measures about itself (``measure:``)."""

    memory: bool = True
    """Categorised live-tensor tracking (torch MemTracker); on CUDA the allocator peak is
    recorded in every case."""
    memory_steps: Literal["auto", "all"] | NonNegativeInt = "auto"
    """Steps under the tracker: 'auto' = the first two plus any later step whose batch shape
    is the largest so far (this catches the run's peak while leaving most steps untracked and
    fast), 'all', or the first N."""
    warmup_steps: NonNegativeInt = 1
    """Steps excluded from throughput (compilation, allocator warm-up, lazy init)."""


@dataclass(frozen=True)
class Platform:
    """What the machine a run is validated for can do: CUDA devices, bf16, installed packages.
    A run validates against :meth:`detect` (this machine); ``memlab estimate --device cuda``
    validates against :meth:`cuda_machine` (a GPU machine with the GPU extras installed), so
    no check reads ``torch.cuda`` or the installed packages itself."""

    cuda: bool = False
    gpus: int = 0
    bf16: bool = False
    """bf16 kernels on the CUDA device (every CPU build has them)."""
    assume_installed: frozenset[str] = frozenset()
    """Packages counted as installed whether or not they are (a hypothetical machine)."""

    @classmethod
    def detect(cls) -> Platform:
        import torch

        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0,
                   bf16=bool(cuda and torch.cuda.is_bf16_supported()))

    @classmethod
    def cuda_machine(cls, gpus: int = 0) -> Platform:
        """A CUDA machine with bf16 and the ``gpu`` extra installed; ``gpus`` 0 = unknown."""
        gpu_only = frozenset(m for m, extra in _guards.EXTRAS.items() if extra.startswith("gpu"))
        return cls(cuda=True, gpus=gpus, bf16=True, assume_installed=gpu_only)

    def has(self, module: str) -> bool:
        """Whether ``module`` can be imported here (checked without importing it)."""
        return module in self.assume_installed or _guards.has(module)

    def missing(self, module: str, what: str) -> str | None:
        """None if ``module`` is installed, else an error naming the extra that provides it."""
        return None if module in self.assume_installed else _guards.missing(module, what)


@dataclass(frozen=True)
class BuildContext:
    """Everything a builder may know besides its own config: the other groups' choices, the
    device and the world size. Frozen: builders read it, never change it."""

    method: Any
    generation: Any
    packing: Any
    attention: Any
    precision: Any
    offload: Any
    peft: Any
    distributed: Any
    model: Any
    data: Any
    logger: Any
    train: TrainConfig
    measure: MeasureConfig
    device: str = "cpu"
    world_size: int = 1
    rank: int = 0
    choices: dict[str, str] = field(default_factory=dict)
    run_dir: Path = Path(".")
    platform: Platform = field(default_factory=Platform)
    """The machine the run is validated for (:meth:`Platform.detect` in a run)."""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def groups(self) -> dict[str, Any]:
        """The typed config of every group, by group name."""
        from memlab.registry import GROUPS

        return {g: getattr(self, g) for g in GROUPS}
