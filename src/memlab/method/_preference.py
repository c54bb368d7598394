"""What the offline preference methods (``dpo``, ``kto``) share in their batches: whether the head
runs at the scored positions only, and the collator's entry point (:class:`PreferenceBatches`).

Not an option of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memlab.method._knobs import HeadOn
from memlab.method.base import Batch, drops_padding_mask

if TYPE_CHECKING:
    from memlab.context import BuildContext


class PreferenceBatches(HeadOn):
    """Mixed into the configs of ``dpo`` and ``kto`` (they implement ``_collate``)."""

    use_liger_kernel: bool

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
