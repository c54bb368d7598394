"""`packing=wrapped`: all tokens concatenated into one stream and cut into max_length blocks.
Documents may cross rows (the tail of a document opens the next row with restarted positions,
so it loses the context of its head); no token is lost, fill is ~100%. Not for methods whose
loss needs each sequence whole (preference pairs: packing/base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.packing.base import Packing, register
from memlab.packing.plan import Strategy


@register("wrapped")
@dataclass(kw_only=True)
class Wrapped(Packing):
    """No knobs; the row capacity is method.max_length."""

    keeps_overflow: ClassVar[bool] = True
    cuts_sequences: ClassVar[bool] = True
    strategy: ClassVar[Strategy] = "wrapped"
