"""`packing=bfd_split`: long sequences are first split into chunks of at most max_length (positions
restart in each chunk), then Best-Fit Decreasing; no token is lost.

Preference methods (units of several sequences, packing/groups.py): a unit larger than a row is
split into its sequences (never cut), placed in rows of the same micro-batch; no token the
method's own limits keep is lost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from memlab.packing.base import Packing, register
from memlab.packing.plan import Strategy


@register("bfd_split")
@dataclass(kw_only=True)
class BfdSplit(Packing):
    """No knobs; the row capacity is method.max_length."""

    keeps_overflow: ClassVar[bool] = True
    strategy: ClassVar[Strategy] = "bfd_split"
