"""The generation engine interface (mirror of the lead's ``generation/base.py``; reconciled at
merge). An engine samples one completion per row of a left-padded prompt batch and keeps its
own copy of the policy's weights in step with the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """What to sample, named as in transformers' ``generate`` / vLLM's ``SamplingParams``."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    eos: int | None = None
    pad: int = 0
    greedy: bool = False


@dataclass
class Samples:
    """One completion per prompt row."""

    completion: torch.Tensor
    """``[N, L]`` long; tokens after the first EOS are set to pad."""
    mask: torch.Tensor
    """``[N, L]`` long; 1 up to and including the first EOS."""
    finished: torch.Tensor
    """``[N]`` bool; an EOS was sampled."""
    lengths: list[int]
    """Host copy of ``mask.sum(1)``."""
    finished_list: list[bool]
    """Host copy of ``finished``."""
    logprobs: torch.Tensor | None = None
    """``[N, L]`` the sampler's own log-probs of the sampled tokens (vLLM), else None."""


class Engine(Protocol):
    """A generation engine."""

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams) -> Samples:
        """Sample one completion per row of the left-padded ``prompt_ids`` ``[N, P]``."""
        ...

    def sync_weights(self, model) -> float:
        """Push the policy's current trainable weights; returns the seconds it took."""
        ...

    def close(self) -> None:
        """Release the engine (processes, memory, connections)."""
        ...
