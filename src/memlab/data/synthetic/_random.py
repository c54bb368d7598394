"""The one random source of a generator call, and the rows of lognormal length drawn from it.

Every draw goes through ``Sampler.rnd`` (one ``random.Random(seed)``), in a fixed order, so the
same arguments always give the same rows.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from memlab.data.synthetic._words import Topic

DEFAULT_SIGMA = 1.1
"""Log-std of the row lengths: p90 ~4x, p99 ~13x the median."""
# The token estimate slightly undercounts (rare words split in two); keep the cap safe.
CAP_MARGIN = 0.92
ATTEMPTS = 6
SLACK = 400
"""Rows sampled this far below the cap cannot exceed it (the content floors are smaller)."""


class Sampler:
    """All randomness of one generator call (one ``random.Random``)."""

    def __init__(self, seed: int, median_tokens: int, max_tokens: int, sigma: float | None = None):
        sigma = DEFAULT_SIGMA if sigma is None else float(sigma)
        if median_tokens <= 0 or max_tokens <= 0:
            raise ValueError("median_tokens and max_tokens must be positive")
        self.rng = random.Random(seed)
        self.rnd = self.rng.random
        self.median = float(median_tokens)
        self.cap = max(32, int(max_tokens * CAP_MARGIN))
        self.sigma = sigma

    def pick(self, seq: Sequence[Any]) -> Any:
        """One element of ``seq``, uniformly."""
        return seq[int(self.rnd() * len(seq))]

    def randint(self, lo: int, hi: int) -> int:
        """A uniform integer in ``[lo, hi]``."""
        return lo + int(self.rnd() * (hi - lo + 1))

    def weighted(self, items: Sequence[Any], weights: Sequence[float]) -> Any:
        """One of ``items`` with probability proportional to its weight."""
        r = self.rnd() * sum(weights)
        for item, w in zip(items, weights):
            r -= w
            if r < 0:
                return item
        return items[-1]

    def length(self) -> int:
        """One lognormal total length in tokens, clamped to [24, cap]."""
        u1, u2 = self.rnd(), self.rnd()
        z = math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)
        return int(min(self.cap, max(24.0, self.median * math.exp(self.sigma * z))))

    def other_noun(self, topic: Topic, key: str) -> str:
        """A noun of ``topic`` other than ``key``."""
        m = self.pick(topic.nouns)
        while m == key:
            m = self.pick(topic.nouns)
        return m


def draw_rows(
    g: Sampler,
    n: int,
    build: Callable[[Sampler, int], dict],
    tokens: Callable[[dict], int] | None = None,
) -> list[dict]:
    """``n`` rows ``build(g, total)``, each for its own lognormal ``total`` length.

    With ``tokens`` (a row's estimated length), a row that may pass the cap and does is drawn
    again at half the length, up to ``ATTEMPTS`` times in all.
    """
    rows = []
    for _ in range(n):
        total = g.length()
        for _attempt in range(ATTEMPTS):
            row = build(g, total)
            if tokens is None or total + SLACK <= g.cap or tokens(row) <= g.cap:
                break
            total //= 2  # overshot a small max_tokens: retry with a shorter row
        rows.append(row)
    return rows
