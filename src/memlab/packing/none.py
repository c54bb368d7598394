"""`packing=none`: one sequence per row; the collator pads (or, with padding_free, flattens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from memlab.measure.data import DataStats
from memlab.registry import register


@register("packing", "none")
@dataclass(kw_only=True)
class NoPacking:
    """No knobs."""

    packs: ClassVar[bool] = False
    keeps_overflow: ClassVar[bool] = False
    cuts_sequences: ClassVar[bool] = False

    def validate(self, ctx) -> list[str]:
        return []

    def batch_items(self, ctx) -> int:
        return ctx.train.batch_size

    def apply(self, ds, stats: DataStats, ctx) -> tuple[Any, DataStats]:
        return ds, stats
