"""The parts the group Protocols are made of that name no run context: what an option returns
or is handed (a generation engine and its samples, the trainer's offload handle, a logging
run, the model factory of a method's extra models), and what some options declare (how a
distributed option shards a rank, its checkpoint states, its ownership of the step; a
quantized base). They sit below :mod:`memlab.protocols.groups`, which names them.

Re-exported by each group's ``base.py`` (``memlab.generation.base.Engine`` is this
:class:`Engine`), where the code that builds on them lives. Imports no torch (its types are
named for annotations only).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

# ------------------------------------------------------------------------------------ model
Head = Literal["causal_lm", "seq_cls"]
"""The head a model is loaded with."""


class ModelFactory(Protocol):
    """Builds the extra models a method needs (the pipeline's loader, same attention / dtype /
    device as the policy). ``overrides``: model-group overrides (a teacher of another size);
    ``head``: 'causal_lm' | 'seq_cls'; ``trainable``: a trained extra model (PPO's value model)
    instead of a frozen one."""

    exact_weights: bool
    """Whether the models hold real weight values (False while estimating on fake tensors):
    checks that compare weights run only when True."""

    def __call__(self, overrides: dict[str, Any] | None = None, *, head: Head | None = None,
                 trainable: bool = False) -> nn.Module: ...

    def tokenizer(self, overrides: dict[str, Any] | None = None) -> Any:
        """The tokenizer of the model group with ``overrides`` (a reward model's own)."""
        ...


# ------------------------------------------------------------------------------------- peft
class QuantizedBase(Protocol):
    """A peft option that stores the frozen base quantized by bitsandbytes (it cannot be merged
    with the adapters): how (read by ``memlab estimate``, which lays the base out the same)."""

    @property
    def bits(self) -> Literal[4, 8]: ...
    @property
    def quant_type(self) -> str: ...
    @property
    def double_quant(self) -> bool: ...
    @property
    def compute_dtype(self) -> str: ...


# ---------------------------------------------------------------------------------- offload
class OffloadHandle(Protocol):
    """The run's offloading of activations, which the trainer drives: entered around each
    forward + loss, ``reset()`` after every micro-batch's backward, ``stats()`` for the
    summary."""

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> None: ...
    def reset(self) -> None: ...
    def stats(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Placement:
    """Where offloaded activations go and which tensors the offloader handles (None: the
    offloader's defaults)."""

    storage: Any = None
    """An :class:`memlab.offload.hooks.OffloadStorage`."""
    key: Any = None
    """``tensor -> hashable``: which storage a tensor views."""
    tensor_types: tuple[type, ...] | None = None


# ----------------------------------------------------------------------------------- logger
class LoggerRun(Protocol):
    """One started logging run: per-step metrics, then the final summary."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Numbers by name; ``eval/samples`` (when present) is a list of ``{"step", "prompt",
        "completion"}`` rows (a table)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the run is and where its settings came from (summary.json's ``logger``)."""
        ...

    def finish(self, summary: dict[str, Any]) -> None: ...


# ------------------------------------------------------------------------------ distributed
class StepOwner(Protocol):
    """A wrapper that owns backward and the optimizer step (DeepSpeed's engine)."""

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The torch optimizer inside the wrapper (memlab's LR schedule sets its groups)."""
        ...

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None: ...

    def step(self, model: nn.Module) -> float | None:
        """Clip, step, zero the gradients; the gradient norm before clipping."""
        ...


class GatheredStates(Protocol):
    """Checkpoints gathered from the shards by parameter name (``by_name``: FSDP2). Both calls
    are collectives: every rank makes them."""

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The unsharded trainable weights, by name, and the optimizer state, on the CPU."""
        ...

    def load_full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        weights: dict[str, Any], optim: dict[str, Any]) -> None:
        """Shard a :meth:`full_state` back onto this rank's model and optimizer."""
        ...


class NativeStates(Protocol):
    """Checkpoints in the wrapper's own sharded format (``native``: DeepSpeed)."""

    def save_states(self, model: nn.Module, path: Path) -> dict[str, str]:
        """Every rank writes its shards of weights and optimizer state under ``path``; returns
        the sha256 of every rank's files (hashed as they were written), by path relative to
        ``path``."""
        ...

    def load_states(self, model: nn.Module, path: Path) -> None: ...

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The trainable weights, whole, by name, on the CPU (a collective when sharded)."""
        ...


@dataclass(frozen=True)
class Sharding:
    """What one rank of a distributed option holds, declared for ``memlab estimate`` (the ZeRO
    stage it reports; the model of :mod:`memlab.estimate.sharding` for a wrapper it cannot run
    on fake tensors)."""

    zero_stage: int = 0
    """What is split over the ranks: 0 nothing (every rank a replica), 1 optimizer state,
    2 + gradients, 3 + parameters."""
    gradient_as_bucket_view: bool = False
    """Replicas (stage 0) reduce gradients in resident buckets (DDP); True: the gradients live
    inside them instead of beside them."""


class MultiProcess(Protocol):
    """A multi-process option (``Distributed.as_ranks()``): its ranks, its process group, its
    rendezvous (:class:`memlab.distributed.base.Ranks`, which every such option builds on)."""

    nproc: int | None
    """Ranks on this machine (None: one per visible GPU on CUDA, 2 on CPU)."""
    timeout_s: int
    """How long a rank waits in a collective before the run fails."""
    master_port: int
    """Port of the rendezvous store the run's process holds (0: one the OS gives)."""

    def backend_for(self, device: str) -> str:
        """The process group's backend on ``device``."""
        ...


OptimizerTensors = Literal["parameters", "dtensors", "flat_partitions"]
"""What a distributed option hands the optimizer (``Distributed.optimizer_tensors``)."""


# ------------------------------------------------------------------------------- generation
@dataclass(frozen=True)
class SamplingParams:
    """One sampling request, named as transformers' ``generate`` / vLLM's SamplingParams."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    eos: int | None = None
    pad: int = 0
    greedy: bool = False
    """Argmax decoding (tests compare engines with it)."""
    n: int = 1
    """Completions per prompt (vLLM's name; a GRPO group): the samples hold ``n`` rows per
    prompt row, in prompt order, and an engine prefills each prompt once for all of them."""


@dataclass
class Samples:
    """Completions of a batch of prompts, on the device and on the host
    (:func:`memlab.generation.base.samples_from` makes them of raw completions)."""

    completion: torch.Tensor
    """``[N, L]`` token ids; tokens after the first EOS are the pad id."""
    mask: torch.Tensor
    """``[N, L]`` 1 up to and including the first EOS, else 0."""
    finished: torch.Tensor
    """``[N]`` bool: an EOS was sampled."""
    token_ids: list[list[int]]
    """Host copy: each completion's tokens up to and including its first EOS."""
    finished_list: list[bool]
    """Host copy of ``finished``."""
    logprobs: torch.Tensor | None = None
    """``[N, L]`` the sampler's own log-probs of the sampled tokens (vLLM), else None."""

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.token_ids]


class Engine(Protocol):
    """Samples completions from the policy (:mod:`memlab.generation.base`)."""

    syncs_weights: ClassVar[bool]
    """Whether the engine keeps its own copy of the weights (then the trainer pushes the
    policy's after optimizer steps, and measures how long that takes)."""
    placeholder_samples: ClassVar[bool]
    """Whether its samples stand in for real ones (an estimate's worst case: every completion
    at full length): a method must then lay out every completion, deciding nothing on their
    values (as leaving out those whose loss term is zero)."""

    def start(self, model: torch.nn.Module,
              untracked: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> None:
        """Get ready to generate from ``model`` (idempotent). The trainer calls it before the
        first step, outside the memory tracker, and passes ``untracked`` (its probe's): an
        engine that keeps its own memory in the training process (a colocated vLLM) runs its
        own work inside it, so its weights, KV cache and decoding buffers are reported by
        :meth:`memory`, not counted as the trainer's tensors."""
        ...

    def generate(self, model: torch.nn.Module, prompt_ids: torch.Tensor,
                 prompt_mask: torch.Tensor, params: SamplingParams) -> Samples:
        """``params.n`` completions per row of the LEFT-padded ``prompt_ids`` ``[N, P]``
        (``[N * n, L]``, each prompt's in a row), each prompt prefilled once."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> float:
        """Push the policy's current weights to the engine; returns the seconds it took."""
        ...

    def corrects_sampling(self) -> bool:
        """Whether :meth:`importance_weights` applies (then samples carry ``logprobs``)."""
        ...

    def importance_weights(self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor,
                           mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]] | None:
        """Per-token weights correcting the mismatch between the sampler's log-probs and the
        trainer's (truncated importance sampling), or None when the engine applies none."""
        ...

    def memory(self) -> dict[str, int | None]:
        """What the engine holds outside the trainer's tensors (its weights, its KV cache)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineMemory:
    """What a generation engine holds in the training process's device memory beside the
    trainer's tensors, as ``memlab estimate`` models it (a run measures it: the summary's
    ``memory.generation_engine``, same keys)."""

    weights_bytes: int
    """The engine's own copy of the policy's weights."""
    kv_cache_bytes: int
    """Its KV cache (reserved whole when the engine starts)."""
    released_in_training: bool
    """Sleep mode: held only while generating, released for forward / backward / optimizer."""
    note: str
    """How the numbers were found (the estimate's assumptions)."""

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


class GenerationEnv:
    """What an online method's ``rollout`` gets: the engine that samples from the policy, an
    engine for other models (``local``: transformers' generate on the model itself, e.g. a GKD
    teacher), the run's random draws, and when the engine's weights need the policy's (after
    an optimizer step, before the next generate)."""

    def __init__(self, engine: Engine, rng: random.Random, local: Engine | None = None):
        self.engine = engine
        self.local = local if local is not None else engine
        self.rng = rng
        self._stale = False

    def start(self, model: torch.nn.Module,
              untracked: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> None:
        """Before the first step (see :meth:`Engine.start`)."""
        self.engine.start(model, untracked)

    def weights_changed(self) -> None:
        """The policy took an optimizer step."""
        self._stale = self.engine.syncs_weights

    def sync(self, model: torch.nn.Module) -> float | None:
        """Before generating: push the weights if they changed; seconds it took, or None when
        the engine samples from the policy itself."""
        if not self.engine.syncs_weights:
            return None
        if not self._stale:
            return 0.0
        t0 = time.perf_counter()
        self.engine.sync_weights(model)
        self._stale = False
        return time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()
