"""What a generation option provides, and what an online method gets from it.

An option (``generation=<name>``) is a registered dataclass with ``validate(ctx)`` and
``build(ctx, tokenizer, policy) -> Engine``. An :class:`Engine` samples one completion per row of a
left-padded prompt batch from the training policy (:meth:`Engine.generate`) and, if it keeps its
own copy of the weights (vLLM), takes the policy's new weights after optimizer steps
(:meth:`Engine.sync_weights`). The trainer hands online methods a :class:`GenerationEnv`: the
engine, the run's random draws (GKD's on-policy coin), and the bookkeeping of when the engine's
weights are stale. Those types and the group's Protocol (:class:`Generation`) are in
:mod:`memlab.protocols`, re-exported here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

import torch

from memlab import registry
from memlab.protocols import (
    Engine,
    EngineMemory,
    Generation,
    GenerationEnv,
    Samples,
    SamplingParams,
)


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


GenerationClass = TypeVar("GenerationClass", bound=Generation)


def register(name: str) -> Callable[[type[GenerationClass]], type[GenerationClass]]:
    """Register a ``generation=`` option (mypy checks it against :class:`Generation`)."""
    return registry.register("generation", name)


def run_rng(seed: int, rank: int) -> random.Random:
    """The run's random draws for rollouts (a stream per rank)."""
    return random.Random(seed * 7919 + rank)


__all__ = ["Engine", "EngineMemory", "Generation", "GenerationEnv", "SamplingParams", "Samples",
           "register", "run_rng", "samples_from"]
