"""What a packing option does in the pipeline (:class:`PackingOption`), and what the
strategies share (:class:`Packing`).

Rules owned here: packing applies only to methods that declare ``supports_packing``; methods
whose rows pack as units of several sequences (:class:`memlab.packing.groups.GroupPacked`:
preference pairs, KTO examples with their KL partner) take only the strategies that keep every
sequence whole, and ``bfd_split`` needs room in a micro-batch for a unit split into its
sequences. Whether the attention backend can keep packed sequences apart is the attention
option's rule (it owns ``isolates_packed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from memlab.measure.data import DataStats
from memlab.packing.groups import GroupPacked


class PackingOption(Protocol):
    """A ``packing=`` option."""

    packs: ClassVar[bool]
    """Whether rows hold several sequences (every strategy but ``none``)."""
    keeps_overflow: ClassVar[bool]
    """The strategy itself handles sequences longer than the row capacity (bfd_split splits
    them, wrapped streams them), so the method must not truncate first."""
    cuts_sequences: ClassVar[bool]
    """A sequence may be cut across rows (wrapped)."""

    def validate(self, ctx) -> list[str]: ...
    def apply(self, ds, stats: DataStats, ctx) -> tuple[Any, DataStats]: ...
    def batch_items(self, ctx) -> int:
        """Items of the prepared (packed) dataset per micro-batch: ``train.batch_size`` rows,
        or 1 where each item is a whole micro-batch (units packed in groups)."""
        ...


def packing_errors(packing, ctx) -> list[str]:
    """The rules between packing and the method (module docstring), one message each."""
    if not packing.packs:
        return []
    method = ctx.method
    if not method.supports_packing:
        if method.generates():
            why = "its batches are completions it generates during training"
            fix = "use packing=none"
        else:
            why = "its rows are pairs or scored sequences"
            fix = "use packing=none" + (" and method.padding_free=true to drop the padding"
                                        if method.supports_padding_free else "")
        return [f"packing={packing.name} does not apply to method={method.name} ({why}); {fix}"]
    if not isinstance(method, GroupPacked):
        return []
    if packing.cuts_sequences:
        return [f"packing={packing.name} cuts sequences across rows, and method={method.name}'s "
                "loss needs each sequence whole (its log-probs, its reward); use packing=bfd "
                "(units that do not fit a row are truncated) or packing=bfd_split (they are "
                "split into their sequences, none cut)"]
    pieces = method.unit_pieces()
    if packing.keeps_overflow and ctx.train.batch_size < pieces:
        return [f"packing={packing.name} puts the {pieces} sequences of a unit too long for one "
                f"row into {pieces} rows of one micro-batch, and train.batch_size="
                f"{ctx.train.batch_size} rows per micro-batch is fewer; set train.batch_size >= "
                f"{pieces} or use packing=bfd"]
    return []


@dataclass(kw_only=True)
class Packing:
    """Packing strategies share one shape: ``apply(ds, stats, ctx) -> (ds, stats)``."""

    packs: ClassVar[bool] = True
    keeps_overflow: ClassVar[bool] = False
    cuts_sequences: ClassVar[bool] = False
    strategy: ClassVar[str] = ""

    def validate(self, ctx) -> list[str]:
        return packing_errors(self, ctx)

    def batch_items(self, ctx) -> int:
        return 1 if isinstance(ctx.method, GroupPacked) else ctx.train.batch_size

    def apply(self, ds, stats: DataStats, ctx) -> tuple[Any, DataStats]:
        if isinstance(ctx.method, GroupPacked):
            return self._apply_groups(ds, stats, ctx)
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

    def _apply_groups(self, ds, stats: DataStats, ctx) -> tuple[Any, DataStats]:
        """Units (pairs, KTO examples) into micro-batches of ``train.batch_size`` rows."""
        from memlab.packing import groups

        whole, pieces = ctx.method.unit_sizes(ds, ctx)
        packed, gs = groups.apply(ds, whole, pieces, ctx.method.max_length,
                                  ctx.train.batch_size, split=self.keeps_overflow)
        stats.rows = gs.rows
        stats.fill_ratio = gs.fill_ratio
        stats.packing_seconds = gs.seconds
        stats.extra["micro_batches"] = gs.packs
        stats.extra["units_split"] = gs.split_units
        return packed, stats
