"""What a packing option does in the pipeline (:class:`PackingOption`), and what the
strategies share (:class:`Packing`).

Rules owned here: packing applies only to methods that declare ``supports_packing``. Whether the
attention backend can keep packed sequences apart is the attention option's rule (it owns
``isolates_packed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from memlab.measure.data import DataStats


class PackingOption(Protocol):
    """A ``packing=`` option."""

    packs: ClassVar[bool]
    """Whether rows hold several sequences (every strategy but ``none``)."""
    keeps_overflow: ClassVar[bool]
    """The strategy itself handles sequences longer than the row capacity (bfd_split splits
    them, wrapped streams them), so the method must not truncate first."""

    def validate(self, ctx) -> list[str]: ...
    def apply(self, ds, stats: DataStats, ctx) -> tuple[Any, DataStats]: ...


def packing_errors(packing, ctx) -> list[str]:
    """The one rule between packing and the method: it must declare ``supports_packing``."""
    if not packing.packs or ctx.method.supports_packing:
        return []
    if ctx.method.generates():
        why = "its batches are completions it generates during training"
        fix = "use packing=none"
    else:
        why = "its rows are pairs or scored sequences"
        fix = "use packing=none" + (" and method.padding_free=true to drop the padding"
                                    if ctx.method.supports_padding_free else "")
    return [f"packing={packing.name} does not apply to method={ctx.method.name} ({why}); {fix}"]


@dataclass(kw_only=True)
class Packing:
    """Packing strategies share one shape: ``apply(ds, stats, ctx) -> (ds, stats)``."""

    packs: ClassVar[bool] = True
    keeps_overflow: ClassVar[bool] = False
    strategy: ClassVar[str] = ""

    def validate(self, ctx) -> list[str]:
        return packing_errors(self, ctx)

    def apply(self, ds, stats: DataStats, ctx) -> tuple[Any, DataStats]:
        from memlab.packing import core

        # rows carry seq_lengths; the collator builds each batch's positions and document
        # segments from them (position_ids would double the packed dataset's size)
        packed, ps = core.apply(ds, ctx.method.max_length, self.strategy,
                                columns=("input_ids", "labels"), position_ids=False)
        stats.rows = ps.rows
        stats.fill_ratio = ps.fill_ratio
        stats.tokens_dropped += ps.tokens_dropped
        stats.packing_seconds = ps.seconds
        return packed, stats
