"""What a generation option provides, and what an online method gets from it.

An option (``generation=<name>``) is a registered dataclass with ``validate(ctx)`` and
``build(ctx, tokenizer, policy) -> Engine``. An :class:`Engine` samples one completion per row of a
left-padded prompt batch from the training policy (:meth:`Engine.generate`) and, if it keeps its
own copy of the weights (vLLM), takes the policy's new weights after optimizer steps
(:meth:`Engine.sync_weights`). The trainer hands online methods a :class:`GenerationEnv`: the
engine, the run's random draws (GKD's on-policy coin), and the bookkeeping of when the engine's
weights are stale.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch

from memlab import registry
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


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
    """Completions of a batch of prompts, on the device and on the host."""

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


def samples_from(completion: torch.Tensor, eos: int | None, pad: int,
                 logprobs: torch.Tensor | None = None) -> Samples:
    """:class:`Samples` of raw completions ``[N, L]`` (cut at the first EOS; one host read)."""
    if eos is None:
        finished = torch.zeros(completion.shape[0], dtype=torch.bool, device=completion.device)
        first = torch.full_like(finished, completion.shape[1], dtype=torch.long)
    else:
        is_eos = completion == eos
        finished = is_eos.any(1)
        first = torch.where(finished, is_eos.int().argmax(1), completion.shape[1])
    cols = torch.arange(completion.shape[1], device=completion.device)[None, :]
    mask = (cols <= first[:, None]).long()
    completion = completion.masked_fill(mask == 0, pad)
    lengths = mask.sum(1).tolist()
    host = completion.tolist()
    ids = [row[:n] for row, n in zip(host, lengths, strict=True)]
    return Samples(completion, mask, finished, ids, finished.tolist(), logprobs)


class Engine(Protocol):
    """Samples completions from the policy (see the module docstring)."""

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


class Generation(Option, Protocol):
    """A ``generation=`` option."""

    def build(self, ctx: BuildContext, tokenizer: Any, policy: torch.nn.Module) -> Engine:
        """The engine that samples from ``policy`` (the wrapped training model)."""
        ...

    def engine_memory(self, ctx: BuildContext, weight_elements: int, dtype: torch.dtype,
                      device_bytes: int | None) -> EngineMemory | None:
        """What this option's engine will hold on the training device, for an estimate:
        ``weight_elements`` the engine's copy of the weights holds (LoRA: the merged base),
        ``dtype`` the policy's, ``device_bytes`` the device's memory where known. None: the
        engine holds nothing there beyond the trainer's tensors."""
        ...


GenerationClass = TypeVar("GenerationClass", bound=Generation)


def register(name: str) -> Callable[[type[GenerationClass]], type[GenerationClass]]:
    """Register a ``generation=`` option (mypy checks it against :class:`Generation`)."""
    return registry.register("generation", name)


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


def run_rng(seed: int, rank: int) -> random.Random:
    """The run's random draws for rollouts (a stream per rank)."""
    return random.Random(seed * 7919 + rank)


__all__ = ["Engine", "EngineMemory", "Generation", "GenerationEnv", "SamplingParams", "Samples",
           "register", "run_rng", "samples_from"]
