"""What the offline preference methods (``dpo``, ``kto``) share (:class:`PreferenceBatches`): their
row-layout and Liger knobs, the capabilities they answer alike, whether the head runs at the
scored positions only, and the collator's entry point.

Not an option of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memlab.method._knobs import PreferenceRows
from memlab.method._liger import LIGER_LOSS, LigerKnobs
from memlab.method.base import (
    Batch,
    RowLayout,
    drops_padding_mask,
)

if TYPE_CHECKING:
    from memlab.context import BuildContext


class PreferenceBatches(LigerKnobs, PreferenceRows):
    """Mixed into the configs of ``dpo`` and ``kto`` (each answers ``as_extra_models``,
    ``as_group_packed`` and ``as_liger`` itself, so that mypy checks its own reference model
    and units, and implements ``_collate``: a capability answered here would be shadowed by
    :class:`memlab.method.base.NoCapabilities`, which comes first in their MRO)."""

    max_length: int | None

    def row_layout(self, ctx: BuildContext) -> RowLayout:
        return RowLayout(supports_packing=True, supports_padding_free=True,
                         packs_rows=self.padding_free or self.share_prompt or ctx.packing.packs,
                         row_length=self.max_length, pad_to_multiple_of=self.pad_to_multiple_of,
                         keeps_row_end=False)

    def reads_head_weight(self, ctx: BuildContext) -> str | None:
        return LIGER_LOSS if self.liger_loss() else None

    def labelled(self) -> bool:
        """Whether batches list their scored tokens (``head_on=labelled``; Liger's fused loss
        runs its own head over every position)."""
        return self.head_on == "labelled" and not self.use_liger_kernel

    def collate(self, rows: list[dict], tokenizer, ctx: BuildContext) -> Batch:
        return self._collate(rows, tokenizer.pad_token_id,
                             not drops_padding_mask(self.padding_mask, ctx))

    def _collate(self, rows: list[dict], pad_id: int, mask: bool = True) -> Batch:
        """The batch of ``rows`` padded with ``pad_id`` (``mask``: with its attention mask)."""
        raise NotImplementedError
