"""What a packing option does in the pipeline, and the checks all strategies share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from memlab.method.base import DataStats


@dataclass(kw_only=True)
class Packing:
    """Packing strategies share one shape: ``apply(ds, stats, ctx) -> (ds, stats)``.

    ``keeps_overflow``: the strategy itself handles sequences longer than the row capacity
    (bfd_split splits them, wrapped streams them), so the method must not truncate first.
    """

    keeps_overflow: ClassVar[bool] = False
    strategy: ClassVar[str] = ""

    def validate(self, ctx) -> list[str]:
        name = self.name  # type: ignore[attr-defined]
        errors = []
        if not getattr(ctx.method, "supports_packing", False):
            errors.append(
                f"packing={name} does not apply to method={ctx.method.name} (its rows are "
                "pairs or scored sequences); use packing=none"
                + (" and method.padding_free=true to drop the padding"
                   if hasattr(ctx.method, "padding_free") else "")
            )
        elif not ctx.attention.isolates_packed:
            errors.append(
                f"packing={name} puts several documents in one row, which "
                f"attention={ctx.attention.name} cannot keep apart; use attention=sdpa, eager "
                "or flash_attention_2"
            )
        return errors

    def apply(self, ds, stats: DataStats, ctx) -> tuple[Any, DataStats]:
        from memlab.packing import core

        packed, ps = core.apply(ds, ctx.method.max_length, self.strategy,
                                columns=("input_ids", "labels"))
        stats.rows = ps.rows
        stats.fill_ratio = ps.fill_ratio
        stats.tokens_dropped += ps.tokens_dropped
        stats.packing_seconds = ps.seconds
        return packed, stats
