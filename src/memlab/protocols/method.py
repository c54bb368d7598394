"""What a method's Protocol (:class:`memlab.protocols.Method`) answers that names no run
context: :class:`RowLayout`, how its rows are laid out in a run (``Method.row_layout(ctx)``),
one value instead of six questions, read by the packing options, the attention rules, the
estimate and the ``lengths`` / ``data show`` commands. Below :mod:`memlab.protocols.groups`,
which names it; imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowLayout:
    """How a method's prepared rows and collated batches are laid out in one run."""

    supports_packing: bool
    """A ``packing=`` strategy may pack its prepared rows (:mod:`memlab.packing.base`)."""
    supports_padding_free: bool
    """It has a padding-free collation (``method.padding_free``)."""
    packs_rows: bool
    """Its collated rows hold several sequences in this run (packing, padding-free, a shared
    prompt): the attention option must keep them apart."""
    row_length: int | None
    """The longest prepared row it keeps (an online method: its prompts; a packed row's
    capacity), or None (no limit)."""
    pad_to_multiple_of: int | None
    """Padded widths are rounded up to this multiple (None: not rounded)."""
    keeps_row_end: bool
    """Truncation keeps a row's last tokens (cuts its start); False: its first."""
