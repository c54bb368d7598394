"""`packing=none`: one sequence per row; the collator pads (or, with padding_free, flattens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from memlab.measure.data import DataStats
from memlab.packing.base import register
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("none")
@dataclass(kw_only=True)
class NoPacking(Option):
    """No knobs."""

    packs: ClassVar[bool] = False
    keeps_overflow: ClassVar[bool] = False
    cuts_sequences: ClassVar[bool] = False

    def validate(self, ctx: BuildContext) -> list[str]:
        return []

    def batch_items(self, ctx: BuildContext) -> int:
        return ctx.train.batch_size

    def apply(self, ds, stats: DataStats, ctx: BuildContext) -> tuple[Any, DataStats]:
        return ds, stats
