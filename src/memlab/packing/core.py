"""Sequence packing: a plain, fast, deterministic library (no Hydra, no torch).

Packing puts several tokenized sequences side by side into rows of at most ``max_length``
tokens, so that a batch carries (almost) no padding. The three strategies keep the meanings
Hugging Face TRL gives them (``trl.data_utils.pack_dataset``); the differences are that we plan
over the *whole* dataset at once (TRL packs within each 1000-row ``map`` batch) and that the
planner only looks at lengths, so it is cheap to run on millions of sequences.

Strategies, with ``max_length=4`` and sequences ``a=[a0 a1 a2 a3 a4]``, ``b=[b0 b1]``,
``c=[c0 c1 c2]``, ``d=[d0]``:

``"bfd"`` -- Best-Fit Decreasing. Sequences longer than ``max_length`` are truncated (their
    start is kept, the overflow is lost and counted in ``tokens_dropped``). Sequences are taken
    longest first (ties: lower index first) and each goes into the open row with the *smallest*
    remaining capacity that still fits it, or into a new row when none fits. Sequence boundaries
    are kept: no sequence is ever cut across rows::

        [a0 a1 a2 a3] [c0 c1 c2 d0] [b0 b1]          (a4 dropped)

``"bfd_split"`` -- like ``"bfd"``, but a sequence longer than ``max_length`` is first split
    into chunks of at most ``max_length`` (``a -> [a0..a3], [a4]``); every chunk is packed as
    its own piece (positions restart at 0 in each chunk). No token is lost::

        [a0 a1 a2 a3] [c0 c1 c2 a4] [b0 b1 d0]

``"wrapped"`` -- all sequences are concatenated in order into one stream that is cut into
    consecutive blocks of exactly ``max_length`` (only the last block may be shorter).
    Sequences may cross rows; no token is lost; fill is maximal::

        [a0 a1 a2 a3] [a4 b0 b1 c0] [c1 c2 d0]

Empty sequences produce no piece (as in TRL). Two entry points:

* :func:`plan` works on lengths only and returns a :class:`PackPlan`: flat numpy arrays of
  *pieces* (``seq_index``, ``start``, ``end`` token offsets inside the source sequence) grouped
  into rows CSR-style by ``row_offsets``.
* :func:`apply` packs a tokenized :class:`datasets.Dataset` following such a plan: each output
  buffer is allocated once at its final size and filled by numpy copies of whole runs of
  tokens, grouped by run length (no Python per row, piece or token; see ``_arrow``); value
  types are kept (int32 stays int32). The output can be built, and written to an Arrow file,
  shard by shard while the plan stays global (``shard_rows``, ``output_path``).

Best-fit runs in ``O(n log n)``: pieces are grouped by length (at most ``max_length`` distinct
values) and each group is placed in bulk. Within a group of ``k`` pieces of length ``L``, the
best-fit row for the next piece is the row that just received one as long as it still has room
for another ``L``, so each visited row takes ``min(capacity // L, pieces left)`` pieces at once;
rows are kept in FIFO buckets keyed by remaining capacity and the non-empty capacities in a
sorted list. The result is exactly the one-piece-at-a-time best-fit-decreasing result with
FIFO ties among rows of equal remaining capacity (the rule TRL uses), and it is deterministic.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from memlab.packing import _arrow
from memlab.packing.plan import STRATEGIES, PackPlan, Strategy, plan

if TYPE_CHECKING:
    import datasets

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "STRATEGIES",
    "PackPlan",
    "PackStats",
    "Strategy",
    "apply",
    "plan",
]

DEFAULT_SHARD_TOKENS = 1 << 27
"""Tokens per output shard when :func:`apply` writes to a file and no ``shard_rows`` is given
(with int32 ids: ~512 MiB of ids plus as much of position ids per shard)."""


# --------------------------------------------------------------------------------------------
# Packing a datasets.Dataset
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackStats:
    """Summary of one :func:`apply` call."""

    rows: int
    sequences: int
    fill_ratio: float
    tokens_dropped: int
    tokens_in: int
    tokens_out: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (for loggers and JSON)."""
        return asdict(self)


def apply(
    dataset: datasets.Dataset,
    max_length: int,
    strategy: Strategy = "bfd",
    columns: Sequence[str] = ("input_ids",),
    *,
    shard_rows: int | None = None,
    output_path: str | os.PathLike[str] | None = None,
    position_ids: bool = True,
) -> tuple[datasets.Dataset, PackStats]:
    """Pack a tokenized dataset into rows of at most ``max_length`` tokens.

    Every column in ``columns`` must hold, per row, a list as long as the first column's (e.g.
    ``input_ids``, ``completion_mask``, ``labels``); they are all cut and concatenated the
    same way and keep their value type. Other columns are dropped. Each output row holds the
    packed columns plus:

    * ``position_ids`` -- 0, 1, 2, ... restarting at every piece start, i.e. at each sequence
      (or ``bfd_split`` chunk) start. For ``"wrapped"`` positions also restart at every row
      start, so a sequence continued from the previous row starts over at 0 (rows are
      independent training examples; no position ever reaches ``max_length``). int32.
    * ``seq_lengths`` -- the piece lengths in the row, summing to the row length (what
      varlen / flash-attention kernels need as ``cu_seqlens``).

    Rows are not padded (the collator pads). Dataset formatting is not carried over. The plan
    is always global (one :func:`plan` over every row); only the output is built in shards.

    Args:
        dataset: the tokenized dataset, in memory or memory-mapped (Arrow files are read in
            place, pieces copied straight from the mapped files). An indices mapping from
            ``select``/``shuffle`` is applied first, which copies the selected columns.
        max_length: row capacity in tokens.
        strategy: ``"bfd"``, ``"bfd_split"`` or ``"wrapped"`` (see the module docstring).
        columns: the per-token list columns to pack.
        shard_rows: build the output this many rows at a time, one Arrow record batch each.
            Default: all rows at once in memory, or :data:`DEFAULT_SHARD_TOKENS` ``//
            max_length`` rows when writing to ``output_path``.
        output_path: write the packed rows to this new Arrow file (an IPC stream, the format
            of ``datasets`` cache files) shard by shard and return a dataset memory-mapped from
            it, so that memory holds one shard of output at a time, not all of it.
        position_ids: write the ``position_ids`` column (the default). ``False`` leaves it
            out: it is as large as ``input_ids`` (int32 per token) and follows from
            ``seq_lengths`` alone, so a collator can build it per batch instead.

    Returns:
        ``(packed_dataset, stats)``.
    """
    import datasets as hf_datasets

    t0 = time.perf_counter()
    columns = list(columns)
    if not columns:
        raise ValueError("columns must name at least one list column to pack")
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise KeyError(f"columns {missing} not in dataset columns {dataset.column_names}")
    for name in ("position_ids", "seq_lengths"):
        if name in columns:
            raise ValueError(f"column {name!r} is produced by packing; do not pass it in columns")
    if shard_rows is not None and (isinstance(shard_rows, bool) or int(shard_rows) < 1):
        raise ValueError(f"shard_rows must be a positive number of rows, got {shard_rows!r}")
    path = None if output_path is None else Path(output_path)
    if path is not None and path.exists():
        raise FileExistsError(
            f"output_path {str(path)!r} already exists; remove it or pass a new path"
        )

    # Just these columns, with any select/shuffle indices applied (zero-copy otherwise).
    table = dataset.select_columns(columns).with_format("arrow")[:]
    cols = [_arrow.read_column(table.column(c), c) for c in columns]
    del table
    lengths = cols[0].lengths
    for col in cols[1:]:
        if not np.array_equal(col.lengths, lengths):
            raise ValueError(
                f"column {col.name!r} has per-row lengths differing from {columns[0]!r}; "
                "pack only per-token columns (one value per token of every row)"
            )

    pp = plan(lengths, max_length, strategy)
    piece_bounds = np.zeros(pp.num_pieces + 1, dtype=np.int64)
    np.cumsum(pp.piece_lengths, out=piece_bounds[1:])
    n_tok = int(piece_bounds[-1])
    large = max(n_tok, pp.tokens_in, pp.max_length) >= 2**31 - 1
    if shard_rows is None:
        shard_rows = DEFAULT_SHARD_TOKENS // pp.max_length if path is not None else pp.num_rows
    shard_rows = max(1, int(shard_rows))
    edges = [*range(0, pp.num_rows, shard_rows), pp.num_rows] if pp.num_rows else [0, 0]
    names = [*columns, *(["position_ids"] if position_ids else []), "seq_lengths"]
    shards = (
        _arrow.build_shard(cols, pp, piece_bounds, r0, r1, large, names)
        for r0, r1 in zip(edges[:-1], edges[1:])
    )

    # Without an explicit fingerprint, datasets would hash the whole table (seconds at 100k rows).
    src_fp = (
        getattr(dataset, "_fingerprint", None)
        or hf_datasets.fingerprint.generate_random_fingerprint()
    )
    key = f"memlab.packing:{src_fp}:{max_length}:{strategy}:{','.join(columns)}"
    key += "" if position_ids else ":no-position-ids"
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    if path is None:
        import pyarrow as pa

        data = hf_datasets.table.InMemoryTable(pa.Table.from_batches(list(shards)))
    else:
        _arrow.write_stream(path, shards)
        data = hf_datasets.table.MemoryMappedTable.from_file(str(path))
    packed = hf_datasets.Dataset(data, fingerprint=fingerprint)
    stats = PackStats(
        rows=pp.num_rows,
        sequences=int(lengths.shape[0]),
        fill_ratio=pp.fill_ratio,
        tokens_dropped=pp.tokens_dropped,
        tokens_in=pp.tokens_in,
        tokens_out=n_tok,
        seconds=time.perf_counter() - t0,
    )
    return packed, stats
