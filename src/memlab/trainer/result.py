"""What a training loop hands back: steps, losses, curves, the timed steps' throughput and its
spread, padding, checkpoints written and the errors of those that could not be
(:class:`TrainResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainResult:
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    curves: dict[str, list[float]] = field(default_factory=dict)
    """Every logged metric per step (rewards, accuracies, grad norm...)."""
    real_tokens: int = 0
    total_tokens: int = 0
    timed_tokens: int = 0
    timed_seconds: float = 0.0
    timed_samples: int = 0
    timed_steps: int = 0
    timed_rates: list[float] = field(default_factory=list)
    """Tokens/s of each timed step (their spread says how far two runs' speeds can be told
    apart)."""
    throughput_note: str = ""
    checkpoint_errors: list[str] = field(default_factory=list)
    """Checkpoints that could not be written (an unwritable or full disk): the training and its
    measurements went on; the run reports them."""
    checkpoints: list[str] = field(default_factory=list)
    """The checkpoints this run wrote and kept, oldest first (``train.keep_last`` prunes these
    only; the summary names the newest)."""
    profile: dict[str, Any] | None = None
    """``measure.profile_step``'s breakdown (:func:`memlab.measure.profile.summarize`)."""
    counts: dict[str, int] = field(default_factory=dict)
    """Counts the batches report (``Batch.meta["counts"]``: an online method's reward groups,
    those of zero variance), summed over the run's steps and ranks."""

    def throughput(self) -> dict[str, Any]:
        if self.timed_seconds <= 0:
            return {"tokens_per_s": None, "samples_per_s": None, "step_time_s": None,
                    "tokens": self.real_tokens, "note": "no timed steps"}
        rates = self.timed_rates
        mean = sum(rates) / len(rates) if rates else 0.0
        std = (math.sqrt(sum((r - mean) ** 2 for r in rates) / (len(rates) - 1))
               if len(rates) > 1 else None)
        return {
            "tokens_per_s": self.timed_tokens / self.timed_seconds,
            "tokens_per_s_std": std,
            "samples_per_s": self.timed_samples / self.timed_seconds,
            "step_time_s": self.timed_seconds / max(1, self.timed_steps),
            "timed_steps": self.timed_steps,
            "tokens": self.real_tokens,
            **({"note": self.throughput_note} if self.throughput_note else {}),
        }

    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.total_tokens if self.total_tokens else 0.0
