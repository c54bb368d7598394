"""`packing=bfd`: Best-Fit Decreasing over the whole dataset: each row filled up to max_length; a
sequence longer than max_length is truncated first (method.truncation_mode) and loses its
overflow tokens (counted in data.tokens_dropped).

Preference methods (units of several sequences, packing/groups.py): each unit is placed whole
in one row; a unit larger than a row is first cut by the method's own truncation rules (a pair's
completions to a common length, from the right) and the cut tokens are counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.packing.base import Packing, register
from memlab.packing.plan import Strategy


@register("bfd")
@dataclass(kw_only=True)
class Bfd(Packing):
    """No knobs; the row capacity is method.max_length."""

    keeps_overflow: ClassVar[bool] = False
    strategy: ClassVar[Strategy] = "bfd"
