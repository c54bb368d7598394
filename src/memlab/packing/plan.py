"""Packing plans: where every token goes, computed from sequence lengths only (no data, no
torch). :func:`plan` is the planner behind :func:`memlab.packing.core.apply` (the strategies and
the best-fit-decreasing algorithm are described in :mod:`memlab.packing.core`)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Strategy = Literal["bfd", "bfd_split", "wrapped"]
STRATEGIES: tuple[str, ...] = ("bfd", "bfd_split", "wrapped")



@dataclass(frozen=True, eq=False)
class PackPlan:
    """Where every token goes: pieces of source sequences, grouped into rows.

    Piece ``p`` is tokens ``[start[p], end[p])`` of source sequence ``seq_index[p]``; row ``r``
    holds pieces ``row_offsets[r]:row_offsets[r + 1]``, in this order. All arrays are int64.
    """

    seq_index: np.ndarray
    start: np.ndarray
    end: np.ndarray
    row_offsets: np.ndarray
    max_length: int
    strategy: str
    tokens_in: int
    """Total tokens of the input sequences (before any truncation)."""

    @property
    def num_rows(self) -> int:
        """Number of packed rows."""
        return int(self.row_offsets.shape[0] - 1)

    @property
    def num_pieces(self) -> int:
        """Number of pieces (sequences, or chunks of them) over all rows."""
        return int(self.seq_index.shape[0])

    @property
    def piece_lengths(self) -> np.ndarray:
        """Length in tokens of every piece."""
        return self.end - self.start

    @property
    def tokens_out(self) -> int:
        """Real tokens placed into rows."""
        return int(self.piece_lengths.sum())

    @property
    def tokens_dropped(self) -> int:
        """Tokens lost (only ``"bfd"`` drops: the overflow of sequences over ``max_length``)."""
        return self.tokens_in - self.tokens_out

    @property
    def fill_ratio(self) -> float:
        """Real tokens in rows / (``num_rows * max_length``); 0.0 when there is no row."""
        if self.num_rows == 0:
            return 0.0
        return self.tokens_out / (self.num_rows * self.max_length)

    def row_lengths(self) -> np.ndarray:
        """Tokens in each row (int64 array of ``num_rows``)."""
        csum = np.zeros(self.num_pieces + 1, dtype=np.int64)
        np.cumsum(self.piece_lengths, out=csum[1:])
        return csum[self.row_offsets[1:]] - csum[self.row_offsets[:-1]]

    def rows(self) -> list[list[tuple[int, int, int]]]:
        """Rows as Python lists of ``(seq_index, start, end)`` (for inspection and tests)."""
        triples = list(zip(self.seq_index.tolist(), self.start.tolist(), self.end.tolist()))
        offs = self.row_offsets.tolist()
        return [triples[offs[r] : offs[r + 1]] for r in range(self.num_rows)]


def _as_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        raise ValueError("lengths must be >= 0")
    return arr


def plan(
    lengths: Sequence[int] | np.ndarray,
    max_length: int,
    strategy: Strategy = "bfd",
) -> PackPlan:
    """Plan how to pack sequences of the given lengths into rows of at most ``max_length``.

    Args:
        lengths: token count of every source sequence (index = ``seq_index``).
        max_length: capacity of a row, in tokens (>= 1).
        strategy: ``"bfd"``, ``"bfd_split"`` or ``"wrapped"`` (see the module docstring).

    Returns:
        A :class:`PackPlan`; identical inputs give identical plans.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown packing strategy {strategy!r}; choose one of {STRATEGIES}")
    max_length = int(max_length)
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    lens = _as_lengths(lengths)
    tokens_in = int(lens.sum())
    if strategy == "wrapped":
        seq, start, end, row_offsets = _plan_wrapped(lens, max_length)
    else:
        seq, start, end = _pieces(lens, max_length, split=strategy == "bfd_split")
        order, row_offsets = _best_fit_decreasing(end - start, max_length)
        seq, start, end = seq[order], start[order], end[order]
    return PackPlan(
        seq_index=seq,
        start=start,
        end=end,
        row_offsets=row_offsets,
        max_length=max_length,
        strategy=strategy,
        tokens_in=tokens_in,
    )


def _pieces(
    lens: np.ndarray, max_length: int, *, split: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces to pack: each non-empty sequence truncated, or split into ``max_length`` chunks."""
    if not split:
        seq = np.flatnonzero(lens > 0).astype(np.int64)
        return seq, np.zeros_like(seq), np.minimum(lens[seq], max_length)
    n_chunks = -(-lens // max_length)  # ceil; 0 for empty sequences
    seq = np.repeat(np.arange(lens.shape[0], dtype=np.int64), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks  # index of each sequence's first chunk
    chunk_no = np.arange(seq.shape[0], dtype=np.int64) - np.repeat(first, n_chunks)
    start = chunk_no * max_length
    end = np.minimum(start + max_length, lens[seq])
    return seq, start, end


def _take_front(bucket: deque[np.ndarray], n: int) -> np.ndarray:
    """Remove and return the first ``n`` row ids of a FIFO bucket of id chunks."""
    out: list[np.ndarray] = []
    while n > 0:
        head = bucket[0]
        if head.shape[0] <= n:
            out.append(bucket.popleft())
            n -= head.shape[0]
        else:
            out.append(head[:n])
            bucket[0] = head[n:]
            n = 0
    return out[0] if len(out) == 1 else np.concatenate(out)


def _best_fit_decreasing(plen: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit-decreasing bin packing of piece lengths in ``[1, max_length]``.

    Returns ``(order, row_offsets)``: ``order`` lists piece indices row by row (rows in the
    order they were opened, pieces in the order they were placed) and ``row_offsets`` is the
    CSR index of rows into ``order``.
    """
    n = plen.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    # Processing order: longest first, ties by index (a stable sort on the negated length;
    # 16-bit keys make numpy use its radix sort).
    key_dtype = np.uint16 if max_length < 2**16 else np.int64
    by_len = np.argsort((max_length - plen).astype(key_dtype), kind="stable")
    group_sizes = np.bincount(plen, minlength=max_length + 1)
    group_lens = np.flatnonzero(group_sizes)[::-1].tolist()
    group_sizes_l = group_sizes.tolist()
    min_len = group_lens[-1]

    buckets: dict[int, deque[np.ndarray]] = {}  # remaining capacity -> FIFO chunks of row ids
    counts: dict[int, int] = {}  # remaining capacity -> number of rows in that bucket
    open_caps: list[int] = []  # sorted non-empty capacities (only those >= min_len are kept)
    row_of = np.empty(n, dtype=np.int64)  # row of each piece, in processing order
    next_row = 0
    pos = 0

    def put(cap: int, rows: np.ndarray) -> None:
        if cap < min_len:  # nothing left to place can ever fit: forget the rows
            return
        if cap in counts:
            buckets[cap].append(rows)
            counts[cap] += rows.shape[0]
        else:
            buckets[cap] = deque((rows,))
            counts[cap] = rows.shape[0]
            bisect.insort(open_caps, cap)

    for length in group_lens:
        left = group_sizes_l[length]
        placed: list[np.ndarray] = []
        i = bisect.bisect_left(open_caps, length)
        consumed = 0  # open_caps[i:i + consumed] get emptied by this group
        moves: list[tuple[int, np.ndarray]] = []  # deferred: inserting now would shift open_caps
        while left > 0 and i + consumed < len(open_caps):
            cap = open_caps[i + consumed]
            per_row = cap // length
            avail = counts[cap]
            full = left // per_row
            if full >= avail:  # the whole bucket is filled down to below `length`
                rows = _take_front(buckets.pop(cap), avail)
                del counts[cap]
                consumed += 1
                placed.append(np.repeat(rows, per_row))
                moves.append((cap - per_row * length, rows))
                left -= avail * per_row
                continue
            if full:
                rows = _take_front(buckets[cap], full)
                placed.append(np.repeat(rows, per_row))
                moves.append((cap - per_row * length, rows))
                left -= full * per_row
                counts[cap] -= full
            if left:  # one more row takes the last `left` (< per_row) pieces
                rows = _take_front(buckets[cap], 1)
                placed.append(np.repeat(rows, left))
                moves.append((cap - left * length, rows))
                counts[cap] -= 1
                left = 0
            if counts[cap] == 0:
                del counts[cap], buckets[cap]
                consumed += 1
        del open_caps[i : i + consumed]
        if left > 0:  # open new rows, each filled with as many pieces as fit
            per_row = max_length // length
            n_full, rest = divmod(left, per_row)
            n_new = n_full + (rest > 0)
            rows = np.arange(next_row, next_row + n_new, dtype=np.int64)
            next_row += n_new
            placed.append(np.repeat(rows, per_row)[:left])
            if n_full:
                moves.append((max_length - per_row * length, rows[:n_full]))
            if rest:
                moves.append((max_length - rest * length, rows[n_full:]))
        for cap, rows in moves:
            put(cap, rows)
        k = group_sizes_l[length]
        row_of[pos : pos + k] = placed[0] if len(placed) == 1 else np.concatenate(placed)
        pos += k

    # Rows in opening order; within a row, pieces in placement (= processing) order.
    within = np.argsort(row_of, kind="stable")
    order = by_len[within]
    row_offsets = np.zeros(next_row + 1, dtype=np.int64)
    np.cumsum(np.bincount(row_of, minlength=next_row), out=row_offsets[1:])
    return order.astype(np.int64, copy=False), row_offsets


def _plan_wrapped(
    lens: np.ndarray, max_length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut the concatenation of all sequences into consecutive ``max_length`` blocks."""
    doc_bounds = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=doc_bounds[1:])
    total = int(doc_bounds[-1])
    if total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, np.zeros(1, dtype=np.int64)
    row_bounds = np.arange(0, total, max_length, dtype=np.int64)
    # Pieces start at every non-empty document start and at every row start inside a document.
    # Both lists are sorted: one searchsorted places every row start among the document starts
    # (``at``: documents starting before it), which gives the merged order directly.
    docs = np.flatnonzero(lens > 0)
    doc_starts = doc_bounds[docs]
    at = np.searchsorted(doc_starts, row_bounds)
    is_doc = doc_starts[np.minimum(at, docs.shape[0] - 1)] == row_bounds
    mid_rows = np.flatnonzero(~is_doc)  # rows starting inside a document
    mids_before = np.cumsum(~is_doc) - ~is_doc  # such rows before each row
    row_offsets = np.empty(row_bounds.shape[0] + 1, dtype=np.int64)
    row_offsets[:-1] = at + mids_before  # a row's first piece, in the merged order
    row_offsets[-1] = docs.shape[0] + mid_rows.shape[0]
    is_mid = np.zeros(row_offsets[-1], dtype=bool)
    is_mid[row_offsets[mid_rows]] = True
    starts = np.empty(is_mid.shape[0], dtype=np.int64)
    starts[is_mid] = row_bounds[mid_rows]
    starts[~is_mid] = doc_starts
    seq = np.empty_like(starts)
    seq[is_mid] = docs[at[mid_rows] - 1]
    seq[~is_mid] = docs
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = total
    offset = starts - doc_bounds[seq]
    return seq, offset, offset + (ends - starts), row_offsets
