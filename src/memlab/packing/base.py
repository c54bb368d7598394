"""What a packing option does in the pipeline (:class:`PackingOption`, in
:mod:`memlab.protocols` and re-exported here), and what the strategies share
(:class:`Packing`).

Rules owned here: packing applies only to methods that declare ``supports_packing`` (their
``row_layout(ctx)``); methods
whose rows pack as units of several sequences (``Method.as_group_packed()``, a
:class:`memlab.protocols.GroupPacked`: preference pairs, KTO examples with their KL
partner) take only the strategies that keep every
sequence whole, and ``bfd_split`` needs room in a micro-batch for a unit split into its
sequences. Whether the attention backend can keep packed sequences apart is the attention
option's rule (it owns ``isolates_packed``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from memlab import registry
from memlab.measure.data import DataStats
from memlab.packing.plan import Strategy
from memlab.protocols import PackingOption
from memlab.registry import Option

if TYPE_CHECKING:
    from memlab.protocols import BuildContext, GroupPacked


PackingClass = TypeVar("PackingClass", bound=PackingOption)


def register(name: str) -> Callable[[type[PackingClass]], type[PackingClass]]:
    """Register a ``packing=`` option (mypy checks it against :class:`PackingOption`)."""
    return registry.register("packing", name)


def packing_errors(packing: PackingOption, ctx: BuildContext) -> list[str]:
    """The rules between packing and the method (module docstring), one message each."""
    if not packing.packs:
        return []
    method = ctx.method
    layout = method.row_layout(ctx)
    if not layout.supports_packing:
        if method.as_generating() is not None:
            why = "its batches are completions it generates during training"
            fix = "use packing=none"
        else:
            why = "its rows are pairs or scored sequences"
            fix = "use packing=none" + (" and method.padding_free=true to drop the padding"
                                        if layout.supports_padding_free else "")
        return [f"packing={packing.name} does not apply to method={method.name} ({why}); {fix}"]
    units = method.as_group_packed()
    if units is None:
        return []
    if packing.cuts_sequences:
        return [f"packing={packing.name} cuts sequences across rows, and method={method.name}'s "
                "loss needs each sequence whole (its log-probs, its reward); use packing=bfd "
                "(units that do not fit a row are truncated) or packing=bfd_split (they are "
                "split into their sequences, none cut)"]
    pieces = units.unit_pieces()
    if packing.keeps_overflow and ctx.train.batch_size < pieces:
        return [f"packing={packing.name} puts the {pieces} sequences of a unit too long for one "
                f"row into {pieces} rows of one micro-batch, and train.batch_size="
                f"{ctx.train.batch_size} rows per micro-batch is fewer; set train.batch_size >= "
                f"{pieces} or use packing=bfd"]
    return []


@dataclass(kw_only=True)
class Packing(Option):
    """Packing strategies share one shape: ``apply(ds, stats, ctx) -> (ds, stats)``."""

    packs: ClassVar[bool] = True
    keeps_overflow: ClassVar[bool] = False
    cuts_sequences: ClassVar[bool] = False
    strategy: ClassVar[Strategy]

    def validate(self, ctx: BuildContext) -> list[str]:
        return packing_errors(self, ctx)

    def batch_items(self, ctx: BuildContext) -> int:
        return 1 if ctx.method.as_group_packed() is not None else ctx.train.batch_size

    def apply(self, ds: Any, stats: DataStats, ctx: BuildContext) -> tuple[Any, DataStats]:
        units = ctx.method.as_group_packed()
        if units is not None:
            return self._apply_groups(units, ds, stats, ctx)
        from memlab.packing import core

        # rows carry seq_lengths; the collator builds each batch's positions and document
        # segments from them (position_ids would double the packed dataset's size)
        packed, ps = core.apply(ds, row_capacity(ctx), self.strategy,
                                columns=("input_ids", "labels"), position_ids=False)
        stats.rows = ps.rows
        stats.fill_ratio = ps.fill_ratio
        stats.tokens_dropped += ps.tokens_dropped
        stats.packing_seconds = ps.seconds
        return packed, stats

    def _apply_groups(self, units: GroupPacked, ds: Any, stats: DataStats, ctx: BuildContext
                      ) -> tuple[Any, DataStats]:
        """Units (pairs, KTO examples) into micro-batches of ``train.batch_size`` rows."""
        from memlab.packing import groups

        whole, pieces = units.unit_sizes(ds, ctx)
        packed, gs = groups.apply(ds, whole, pieces, row_capacity(ctx),
                                  ctx.train.batch_size, split=self.keeps_overflow)
        stats.rows = gs.rows
        stats.fill_ratio = gs.fill_ratio
        stats.packing_seconds = gs.seconds
        stats.extra["micro_batches"] = gs.packs
        stats.extra["units_split"] = gs.split_units
        return packed, stats


def row_capacity(ctx: BuildContext) -> int:
    """The tokens of a packed row: the method's longest row (``method.max_length``, which the
    method requires when packing is on)."""
    capacity = ctx.method.row_layout(ctx).row_length
    if capacity is None:
        raise ValueError(f"packing={ctx.packing.name} needs a row capacity: set "
                         "method.max_length")
    return capacity
