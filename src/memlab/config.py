"""Top-level (non-group) typed configs (``train:``, ``measure:``) and the machine a run is validated
for (:class:`Platform`). The context every builder reads is :mod:`memlab.context`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from memlab import _guards
from memlab import resolvers as _resolvers  # noqa: F401 - registers ${memlab.asset:...}
from memlab.registry import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seed,
)

DEFAULT_STEPS = 20
"""Optimizer steps a run takes when neither ``train.steps`` nor ``train.epochs`` is set."""

TRL_NAMES: dict[str, str] = {
    "max_steps": "train.steps",
    "num_train_epochs": "train.epochs",
    "learning_rate": "train.lr",
    "per_device_train_batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "lr_scheduler_type": "train.scheduler",
    "save_steps": "train.save_every",
    "save_total_limit": "train.keep_last",
    "logging_steps": "train.log_every",
    "eval_steps": "train.eval_every",
    "per_device_eval_batch_size": "train.eval_batch_size",
    "resume_from_checkpoint": "train.resume_from",
    "metric_for_best_model": "train.best_metric",
    "max_seq_length": "method.max_length",
}
"""The names of transformers' TrainingArguments / TRL's configs users type first, and memlab's
name for each (``train.max_steps=5`` -> ``train.steps=5``)."""


def trl_hint(key: str, value: object = "...") -> str | None:
    """What to type instead of the transformers / TRL setting ``key`` (``max_steps`` or
    ``train.max_steps``) set to ``value``; None when ``key`` is none of them."""
    name = key[len("train."):] if key.startswith("train.") else key
    ours = TRL_NAMES.get(name)
    if ours is None:
        return None
    hint = f"{name} is transformers' / TRL's name; memlab's is {ours}: {ours}={value}"
    if ours == "train.epochs":  # the default config counts steps: say how the two relate
        hint += (" (whole passes over the rows; exclusive with train.steps, which a debug or "
                 "experiment config may set: add train.steps=null there)")
    return hint


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and loop settings (``train:`` in conf/config.yaml)."""

    seed: Seed = 0
    """Seeds model init, data order and dropout."""
    steps: PositiveInt | None = None
    """Optimizer steps to run (TRL's ``max_steps``; the data cycles as needed, reshuffled every
    pass). null: :data:`DEFAULT_STEPS` (20), unless ``epochs`` is set; the two are exclusive."""
    epochs: PositiveInt | None = None
    """Whole passes over the training rows instead of a count of steps (TRL's
    ``num_train_epochs``): the rows after packing, an online method's prompts. One epoch is
    ``ceil(rows / (batch_size * processes * grad_accum))`` optimizer steps, as transformers'
    Trainer counts them: the last micro-batch of a pass may be short, and so may its last step
    (fewer micro-batches), so that every row is trained on once a pass (an online method with
    ``method.num_iterations`` k: k steps a generation batch). summary.json records the steps it
    came to (``train.steps_planned``, ``train.epochs``, ``train.steps_per_epoch``)."""
    batch_size: PositiveInt = 4
    """Rows per micro-batch per device."""
    grad_accum: PositiveInt = 1
    """Micro-batches per optimizer step. The loss is normalised over the whole step's tokens,
    so 1x8 and 8x1 give the same gradient."""
    lr: PositiveFloat = 3e-4
    """The optimizer's learning rate (the peak of ``scheduler``); which optimizer and its own
    knobs: the ``optimizer`` group."""
    weight_decay: NonNegativeFloat = 0.0
    """Decoupled weight decay (AdamW, 8-bit AdamW, Adafactor) or L2 added to the gradient
    (SGD)."""
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
    """Save a checkpoint every N optimizer steps (0 = never): a Hugging Face directory of the
    policy (the model, or its PEFT adapter, and the tokenizer) plus what resuming needs
    (:mod:`memlab.trainer.checkpoint`)."""
    save_final: bool = False
    """Save a checkpoint after the last step (as ``save_every`` does)."""
    save_merged: bool = False
    """With a PEFT adapter: also write the base model with the adapter merged into it
    (``<checkpoint>/merged``, loads with ``AutoModelForCausalLM.from_pretrained``). The base is
    loaded again, unquantized, on the host (QLoRA: merged into the full-precision base)."""
    keep_last: PositiveInt | None = None
    """Keep only the newest N checkpoints of this run dir (None = keep all)."""
    resume_from: str | None = None
    """A checkpoint dir to resume from, or 'latest': the newest checkpoint of this
    configuration (the same training-relevant settings) under the outputs tree
    (``resume_root``)."""
    resume_allow: list[str] = field(default_factory=list)
    """Settings the resumed run may change from the checkpoint's (e.g. ``[train.lr]``, a whole
    group ``[peft]``); any other difference that changes training is refused. summary.json
    records the old and new values."""
    resume_root: str | None = None
    """Where ``resume_from=latest`` looks (recursively). None: the fixed part of Hydra's run and
    sweep dirs (``outputs/`` and ``multirun/`` by default), or the run dir's parent outside a
    Hydra app."""
    progress: bool = True
    """Show a progress bar with live loss and tokens/s."""
    log_every: PositiveInt = 1
    """Send metrics to the logger every N optimizer steps."""
    eval_every: NonNegativeInt = 0
    """Evaluate on the held-out data (``data.eval``) every N optimizer steps, and after the
    last step in every case (0: after the last step only). The evaluation runs without
    gradients in eval mode, in its own memory phase (``eval``), outside the timed steps
    (training tokens/s never counts it); its metrics go to summary.json's ``eval`` and to the
    logger as ``eval/<metric>`` (:mod:`memlab.trainer.evaluate`)."""
    eval_batch_size: PositiveInt | None = None
    """Rows (or prompts) per evaluation micro-batch per device (TRL's
    ``per_device_eval_batch_size``). No gradients and no optimizer step are alive in
    evaluation, so it can be larger than ``batch_size``; the eval loss does not depend on it
    (it is weighted by tokens, or pairs, over the whole held-out set). None: ``batch_size``."""
    eval_samples: NonNegativeInt = 0
    """At every evaluation, the greedy completions of the first K held-out prompts (a
    conversation up to its last user turn, a row's prompt; plain text: its first 32 tokens),
    into summary.json's ``eval.samples`` and a W&B table ``eval/samples``. 0: none."""
    eval_max_new_tokens: PositiveInt = 64
    """New tokens per sample completion (``eval_samples``)."""
    best_metric: str | None = None
    """The eval metric ``save_best`` and ``early_stop`` follow (TRL's
    ``metric_for_best_model``), named as in summary.json's ``eval`` without ``eval/``: ``loss``
    or one of the method's eval metrics, e.g. ``rewards/accuracies`` (DPO) or ``accuracy``
    (reward). None: ``loss`` (``reward`` for online methods, whose evaluation scores greedy
    completions)."""
    greater_is_better: bool | None = None
    """Whether a larger ``best_metric`` is better. None: false for a metric whose name ends
    in ``loss``, true otherwise (as transformers decides)."""
    save_best: bool = False
    """Save a checkpoint at every evaluation that improves ``best_metric`` (as ``save_every``
    does). The best checkpoint survives ``keep_last`` pruning; summary.json's ``eval.best``
    names it."""
    early_stop: PositiveInt | None = None
    """Stop training after this many evaluations in a row without an improvement of
    ``best_metric`` (patience, as transformers' ``EarlyStoppingCallback``); the run ends
    ``ok`` and summary.json's ``eval.stopped_early`` says at which step and why. The count
    survives a resume. None: never stop early."""

    moved_keys: ClassVar[dict[str, str]] = {
        "optimizer": "the optimizer is the config group `optimizer`: optimizer=<adamw | "
                     "adamw_8bit | paged_adamw_8bit | adafactor | sgd> (train.optimizer=sgd "
                     "is now optimizer=sgd)",
        "betas": "AdamW's betas are a knob of the optimizer group: optimizer.betas=[0.9,0.999]",
    }
    """Keys that moved out of ``train:``, with their new spelling (reported by
    :func:`memlab.registry.from_mapping` and, for command-line overrides, before Hydra
    composes: :func:`moved_overrides`)."""

    def errors(self) -> list[str]:
        """Problems of the settings among themselves (``steps`` and ``epochs`` both set)."""
        if self.steps is not None and self.epochs is not None:
            return [f"train.steps={self.steps} and train.epochs={self.epochs} are both set; they "
                    f"are exclusive: keep train.epochs={self.epochs} with train.steps=null, or "
                    f"train.steps={self.steps} with train.epochs=null"]
        return []

    def fixed_steps(self) -> int | None:
        """The steps to run where they do not depend on the data: ``steps``, or
        :data:`DEFAULT_STEPS` when neither ``steps`` nor ``epochs`` is set; None with
        ``epochs`` (counted from the prepared rows: :mod:`memlab.trainer.epochs`)."""
        if self.epochs is not None and self.steps is None:
            return None
        return DEFAULT_STEPS if self.steps is None else self.steps

    def best(self, method) -> tuple[str, bool]:
        """``(best_metric, greater_is_better)`` with their defaults resolved for ``method``."""
        metric = self.best_metric or method.eval_metrics[0]
        greater = (not metric.endswith("loss") if self.greater_is_better is None
                   else self.greater_is_better)
        return metric, greater

    def eval_rows(self) -> int:
        """Rows (or prompts) per evaluation micro-batch."""
        return self.eval_batch_size or self.batch_size


def moved_overrides(overrides: list[str]) -> list[str]:
    """An error for each command-line override of a key that moved out of ``train:``
    (``train.optimizer=sgd``): Hydra itself would only say that the key is not in the config."""
    errors = []
    for o in overrides:
        if o.startswith("-") or "=" not in o:
            continue
        key = o.split("=", 1)[0].lstrip("+~")
        head, _, rest = key.partition(".")
        if head == "train" and rest in TrainConfig.moved_keys:
            errors.append(f"{key} has moved: {TrainConfig.moved_keys[rest]}")
    return errors


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
    profile_step: NonNegativeInt | None = None
    """Run this step (0-based) under torch.profiler: a trace, the operator table and the step's
    time by phase and by kind of work into ``<run dir>/profile/`` and summary.json's
    ``profile`` (:mod:`memlab.measure.profile`). The step runs without the memory tracker and
    is left out of tokens/s. null = no profile."""

    def always_tracks(self, step: int) -> bool:
        """Whether the tracker runs ``step`` whatever its batch: every step ('all'), the first
        N, or auto's first two (step 0: cold; step 1: the first with optimizer state)."""
        mode = self.memory_steps
        if mode == "all":
            return True
        return step < (mode if isinstance(mode, int) else 2)

    def errors(self, train: TrainConfig) -> list[str]:
        """Problems of the measuring knobs against the training's."""
        step = self.profile_step
        if step is None:
            return []
        errors = []
        steps = train.fixed_steps()  # (with train.epochs: checked once the rows are counted)
        if steps is not None and step >= steps:
            errors.append(profile_step_past(step, steps))
        if self.memory and self.always_tracks(step):
            errors.append(f"measure.profile_step={step} is a step the memory tracker runs "
                          f"(measure.memory_steps={self.memory_steps}), whose dispatch mode would be most of "
                          "the profile; profile a later step (auto tracks steps 0 and 1) or set "
                          "measure.memory=false")
        return errors


def profile_step_past(step: int, steps: int, epochs: int | None = None) -> str:
    """The error of a ``measure.profile_step`` at or past the run's ``steps``."""
    what = (f"train.epochs={epochs} comes to {steps} steps, " if epochs is not None
            else f"train.steps={steps} runs ")
    return (f"measure.profile_step={step} is past the last step ({what}steps 0..{steps - 1}); "
            f"pick a step below {steps}")


@dataclass(frozen=True)
class Platform:
    """What the machine a run is validated for can do: CUDA devices, bf16, installed packages.
    A run validates against :meth:`detect` (this machine); ``memlab estimate --device cuda``
    validates against :meth:`cuda_machine` (a GPU machine with the GPU extras installed), so
    no check reads ``torch.cuda`` or the installed packages itself."""

    cuda: bool = False
    gpus: int = 0
    bf16: bool = False
    """bf16 kernels on the CUDA device."""
    cpu_bf16: bool = False
    """oneDNN's bf16 kernels on this CPU (AVX-512 or AMX on x86, the BF16 extension on Arm):
    without them a bf16 matmul runs a reference loop (measured 58x slower than fp32 on an
    AVX2-only CPU). ``MEMLAB_CPU_BF16=1|0`` overrides the detection (:data:`CPU_BF16_ENV`)."""
    cpu_bf16_env: str | None = None
    """``MEMLAB_CPU_BF16``'s value where it is set (what :attr:`cpu_bf16` then says, instead of
    the detection); None where unset."""
    assume_installed: frozenset[str] = frozenset()
    """Packages counted as installed whether or not they are (a hypothetical machine)."""
    detected: bool = False
    """This machine, read by :meth:`detect` (not a platform given for a hypothetical machine)."""
    triton_interpret: bool = False
    """Triton interprets its kernels on the CPU (``TRITON_INTERPRET=1`` in the environment the
    process started with: Triton reads it when it is imported)."""

    @classmethod
    def detect(cls) -> Platform:
        import torch

        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0,
                   bf16=bool(cuda and torch.cuda.is_bf16_supported()),
                   cpu_bf16=_cpu_bf16(), cpu_bf16_env=os.environ.get(CPU_BF16_ENV) or None,
                   detected=True, triton_interpret=os.environ.get("TRITON_INTERPRET") == "1")

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


CPU_BF16_ENV = "MEMLAB_CPU_BF16"
"""``MEMLAB_CPU_BF16=1`` / ``0``: take this CPU as one with / without bf16 kernels, whatever it
has (what ``precision=auto`` resolves to on a CPU: ``bf16_mixed`` / ``fp32``). For a run that
must not depend on the machine (the test suite, a benchmark repeated on other CPUs). Recorded
in summary.json (``device.cpu_bf16_env``)."""


def cpu_bf16_env_problems() -> list[str]:
    """A :data:`CPU_BF16_ENV` value other than 1 or 0 (checked with the configuration)."""
    value = os.environ.get(CPU_BF16_ENV)
    if value and value not in ("0", "1"):
        return [f"{CPU_BF16_ENV}={value!r}: set it to 1 (this CPU has bf16 kernels) or 0 (it has "
                "not), or unset it to detect them"]
    return []


def _cpu_bf16() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (torch's own check, the one its mkldnn
    matmuls take; False where the build has no such check), unless :data:`CPU_BF16_ENV` says."""
    forced = os.environ.get(CPU_BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
