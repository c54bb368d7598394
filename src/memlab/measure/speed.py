"""When a measured speed may be ranked (issue 45 item 4), the one rule ``memlab fit`` and
``memlab report`` both judge by:

- a tokens/s enters a ranking (the fastest, a Pareto front, a change against a baseline, a sort
  by speed) only from at least :data:`MIN_TIMED` timed steps (:func:`timed`); fewer, and it is
  "not timed": shown, never ranked;
- two tokens/s differ only beyond the larger of their two spreads (the std of each run's timed
  steps' tokens/s): :func:`faster`, :func:`tied`.

Plain numbers in, so a summary's ``throughput`` section, fit's measured record and a report's
row all use it as they are."""

from __future__ import annotations

import math
from typing import TypeGuard

MIN_TIMED = 3
"""Timed steps a measured tokens/s needs to enter a ranking (fewer: "not timed")."""

NOT_TIMED = "not timed"
"""What a report or a fit shows in place of a speed it does not rank."""


def _finite(value: float | None) -> TypeGuard[float]:
    return value is not None and not isinstance(value, bool) and math.isfinite(value)


def timed(tokens_per_s: float | None, timed_steps: float | None) -> bool:
    """Whether a measured tokens/s may be ranked: a positive number from at least
    :data:`MIN_TIMED` timed steps (an unknown count is not enough)."""
    return (_finite(tokens_per_s) and tokens_per_s > 0
            and _finite(timed_steps) and timed_steps >= MIN_TIMED)


def _spread(a_spread: float | None, b_spread: float | None) -> float:
    """The larger of two spreads (one not measured counts as 0)."""
    return max(a_spread if _finite(a_spread) else 0.0, b_spread if _finite(b_spread) else 0.0)


def faster(a: float, a_spread: float | None, b: float, b_spread: float | None) -> bool:
    """Whether tokens/s ``a`` is measurably faster than ``b``: by more than the larger of the
    two spreads."""
    return a - b > _spread(a_spread, b_spread)


def tied(a: float, a_spread: float | None, b: float, b_spread: float | None) -> bool:
    """Whether two tokens/s are no measured difference: apart by no more than the larger of
    their two spreads."""
    return not faster(a, a_spread, b, b_spread) and not faster(b, b_spread, a, a_spread)
