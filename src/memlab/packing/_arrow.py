"""The buffer work behind :func:`memlab.packing.core.apply`: list columns in, packed columns out.

A packed column is the concatenation of *runs* (pieces) of the source column's flat values, in
plan order. Copying a run is one ``memcpy``; what must be avoided is Python per run or per
token. The trick used here: a 1-D numpy view whose element ``i`` is the ``b`` bytes starting at
byte ``i`` of a buffer (a ``void`` dtype of ``b`` bytes with a 1-byte stride). Indexing such a
view with an array of byte offsets copies whole runs of ``b`` bytes, one ``memcpy`` each, inside
numpy's C loop. Runs are grouped by length (at most ``max_length`` distinct lengths), so one
numpy call copies every run of one length::

    dst_runs[dst_offsets] = src_runs[src_offsets]      # all runs of b bytes at once

Output buffers are allocated once, at their final size, and handed to Arrow without a copy;
``"wrapped"`` reuses the source values when they are one contiguous array (its stream is the
input itself). ``position_ids`` are computed in output order, block by block, from the piece
offsets alone.

Fixed-width value types without nulls (every integer and float type) take this path; anything
else (booleans, strings, nested values, nulls in values) falls back to Arrow's own list-view
flatten, which is exact but slower.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from memlab.packing.plan import PackPlan

_CHUNK_BYTES = 1 << 20
"""Runs are copied through a temporary of at most this many bytes (it stays in cache)."""
_BLOCK = 1 << 18
"""Position ids are written this many tokens at a time."""
_MAX_SEGMENTS = 256
"""Most separate buffers (e.g. files) a column is read from in place; more are joined first."""


@dataclass(frozen=True, eq=False)
class SourceColumn:
    """One list column of the source dataset, flattened for packing.

    ``lengths`` has one entry per row. When the values are fixed-width (``width`` > 0), each
    row's values lie in one of the byte views ``segments`` (``row_segment``; ``None``: all in
    the first) from byte ``row_byte``. ``stream`` (with ``stream_start``) is the flat values as
    one Arrow array in row order when there is one (a single chunk, or chunks joined into one);
    ``row_start`` is each row's first value in ``stream``.
    """

    name: str
    value_type: Any
    lengths: np.ndarray
    width: int
    segments: tuple[np.ndarray, ...]
    row_segment: np.ndarray | None
    row_byte: np.ndarray | None
    stream: Any
    stream_start: int
    row_start: np.ndarray | None


def _fixed_width(value_type: Any) -> int:
    """Bytes per value for the fast path, or 0 (booleans are bit-packed, others variable)."""
    import pyarrow as pa

    if not pa.types.is_primitive(value_type) or pa.types.is_boolean(value_type):
        return 0
    bits = value_type.bit_width
    return bits // 8 if bits % 8 == 0 else 0


def _root(buffer: Any) -> Any:
    """The buffer a (zero-copy) Arrow buffer was sliced from, e.g. a whole memory-mapped file."""
    while buffer.parent is not None:
        buffer = buffer.parent
    return buffer


def read_column(column: Any, name: str) -> SourceColumn:
    """Flatten a pyarrow (large) list column, without copying its values when possible.

    One chunk: a view on its values buffer. Several chunks: a view on each buffer they were cut
    from (the memory-mapped file of a ``datasets`` cache file holds all its record batches),
    each row addressed where it lies, so nothing is read before it is copied. Up to
    ``_MAX_SEGMENTS`` such buffers; beyond that, and for the fallback types, the chunks' values
    are joined into one array (one copy of the column).
    """
    import pyarrow as pa

    chunks = list(column.chunks) if isinstance(column, pa.ChunkedArray) else [column]
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        raise TypeError(
            f"packing needs list columns, got type {column.type} for column {name!r}; pass "
            "only per-token list columns (input_ids, labels, masks) in columns"
        )
    if any(chunk.null_count for chunk in chunks):
        raise ValueError(
            f"packing needs list columns without null rows; column {name!r} has null rows "
            "(filter them out or replace them with empty lists first)"
        )
    value_type = column.type.value_type
    offsets = [chunk.offsets.to_numpy().astype(np.int64) for chunk in chunks]
    lengths = (
        np.concatenate([np.diff(o) for o in offsets]) if chunks else np.zeros(0, dtype=np.int64)
    )
    width = _fixed_width(value_type)
    if width and any(chunk.values.null_count for chunk in chunks):
        width = 0  # a validity bitmap would have to be gathered too: take Arrow's path
    if len(chunks) == 1:
        values = chunks[0].values
        return _source(name, value_type, lengths, width, values, offsets[0][:-1])
    buffers = [chunk.values.buffers()[1] for chunk in chunks]
    if width and all(b is not None and b.is_cpu for b in buffers):
        roots = [_root(b) for b in buffers]
        seg_of: dict[tuple[int, int], int] = {}
        for r in roots:
            seg_of.setdefault((r.address, r.size), len(seg_of))
        if len(seg_of) <= _MAX_SEGMENTS:
            first = {seg_of[(r.address, r.size)]: r for r in reversed(roots)}
            chunk_seg = [seg_of[(r.address, r.size)] for r in roots]
            row_byte = np.concatenate(
                [
                    b.address - r.address + (c.values.offset + o[:-1]) * width
                    for b, r, c, o in zip(buffers, roots, chunks, offsets)
                ]
            )
            row_segment = None
            if len(seg_of) > 1:
                rows_per_chunk = [o.shape[0] - 1 for o in offsets]
                row_segment = np.repeat(np.asarray(chunk_seg, dtype=np.int64), rows_per_chunk)
            return SourceColumn(
                name=name,
                value_type=value_type,
                lengths=lengths,
                width=width,
                segments=tuple(
                    np.frombuffer(first[i], dtype=np.uint8) for i in range(len(seg_of))
                ),
                row_segment=row_segment,
                row_byte=row_byte,
                stream=None,
                stream_start=0,
                row_start=None,
            )
    parts = [c.values.slice(int(o[0]), int(o[-1] - o[0])) for c, o in zip(chunks, offsets)]
    joined = pa.concat_arrays(parts) if parts else pa.array([], type=value_type)
    row_start = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=row_start[1:])
    return _source(name, value_type, lengths, width, joined, row_start)


def _source(
    name: str, value_type: Any, lengths: np.ndarray, width: int, values: Any, row_start: Any
) -> SourceColumn:
    """A column whose values are one Arrow array (rows consecutive from ``row_start[0]``)."""
    segments: tuple[np.ndarray, ...] = ()
    row_byte = None
    buffer = values.buffers()[1] if width else None
    if buffer is not None and buffer.is_cpu:
        segments = (np.frombuffer(buffer, dtype=np.uint8),)
        row_byte = (values.offset + row_start) * width
    else:  # no values buffer (empty array) or not in host memory: Arrow's path
        width = 0
    return SourceColumn(
        name=name,
        value_type=value_type,
        lengths=lengths,
        width=width,
        segments=segments,
        row_segment=None,
        row_byte=row_byte,
        stream=values,
        stream_start=int(row_start[0]) if row_start.shape[0] else 0,
        row_start=row_start,
    )


# --------------------------------------------------------------------------------------------
# Runs of bytes
# --------------------------------------------------------------------------------------------


def _runs_view(buf: np.ndarray, nbytes: int) -> np.ndarray:
    """Element ``i`` of the result is ``buf[i:i + nbytes]``, as one ``void`` value (no copy)."""
    return np.ndarray(
        (buf.shape[0] - nbytes + 1,), np.dtype((np.void, nbytes)), buffer=buf, strides=(1,)
    )


@dataclass(frozen=True, eq=False)
class Runs:
    """Pieces of one output shard grouped by (source segment, length): ``order`` sorts them
    stably by that key, ``groups`` yields ``(segment, length, lo, hi)`` for the sorted slice of
    each distinct key, and ``dst`` is each piece's first token in the shard (in ``order``)."""

    order: np.ndarray
    segments: np.ndarray
    lengths: np.ndarray
    bounds: np.ndarray
    dst: np.ndarray

    @classmethod
    def of(
        cls,
        piece_lengths: np.ndarray,
        dst: np.ndarray,
        max_length: int,
        segment: np.ndarray | None = None,
    ) -> Runs:
        """Group pieces of the given lengths (each in ``[1, max_length]``), output at ``dst``
        and read from source ``segment`` (``None``: all from segment 0)."""
        if segment is None:
            key = piece_lengths.astype(np.uint16) if max_length < 2**16 else piece_lengths
        else:
            key = segment * (max_length + 1) + piece_lengths
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        starts = np.flatnonzero(sorted_key[1:] != sorted_key[:-1]) + 1
        bounds = np.concatenate(([0], starts, [order.shape[0]])).astype(np.int64)
        group_key = sorted_key[bounds[:-1]].astype(np.int64) if order.shape[0] else bounds[:0]
        segments, lengths = np.divmod(group_key, max_length + 1)
        return cls(order=order, segments=segments, lengths=lengths, bounds=bounds, dst=dst[order])

    def groups(self) -> Iterator[tuple[int, int, int, int]]:
        """``(segment, length, lo, hi)`` for every distinct key, over the sorted pieces."""
        return zip(
            self.segments.tolist(),
            self.lengths.tolist(),
            self.bounds[:-1].tolist(),
            self.bounds[1:].tolist(),
        )


def copy_runs(
    col: SourceColumn, runs: Runs, seq: np.ndarray, start: np.ndarray, n_tokens: int
) -> Any:
    """The shard's packed values of a fixed-width ``col``: piece ``p`` is values
    ``[start[p], start[p] + length)`` of source row ``seq[p]`` (pieces in plan order), as one
    Arrow array of ``n_tokens`` values (a numpy buffer handed to Arrow without a copy).
    ``runs`` must group the pieces by ``col.row_segment[seq]`` when the column has segments."""
    import pyarrow as pa

    if col.row_byte is None:
        raise ValueError(f"column {col.name!r} has no fixed-width values to copy")
    width = col.width
    dst = np.empty(n_tokens * width, dtype=np.uint8)
    src_byte = (col.row_byte[seq] + start * width)[runs.order]
    dst_byte = runs.dst * width
    for segment, length, lo, hi in runs.groups():
        nbytes = length * width
        dst_view = _runs_view(dst, nbytes)
        src_view = _runs_view(col.segments[segment], nbytes)
        step = max(1, _CHUNK_BYTES // nbytes)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            dst_view[dst_byte[a:b]] = src_view[src_byte[a:b]]
    return pa.Array.from_buffers(col.value_type, n_tokens, [None, pa.py_buffer(dst)])


def position_ids(piece_lengths: np.ndarray, dst: np.ndarray, n_tokens: int) -> Any:
    """int32 ``0, 1, ..., length - 1`` over every piece (pieces at ``dst``, in order), as one
    Arrow array of ``n_tokens`` values.

    Position ``t`` is ``t`` minus the first token of its piece: built block by block (the
    per-block temporaries stay in cache) as ``arange - repeat(piece start, tokens in block)``,
    writing the output once, in order.
    """
    import pyarrow as pa

    out = np.empty(n_tokens, dtype=np.int32)
    ends = dst + piece_lengths
    block_starts = np.arange(0, n_tokens, _BLOCK, dtype=np.int64)
    block_ends = np.minimum(block_starts + _BLOCK, n_tokens)
    first = np.searchsorted(ends, block_starts, side="right")  # first piece ending after a
    stop = np.searchsorted(dst, block_ends, side="left")  # first piece starting at or after b
    ramp = np.arange(_BLOCK, dtype=np.int32)
    for a, b, p0, p1 in zip(
        block_starts.tolist(), block_ends.tolist(), first.tolist(), stop.tolist()
    ):
        starts = np.maximum(dst[p0:p1], a)
        counts = np.minimum(ends[p0:p1], b) - starts
        base = np.repeat((dst[p0:p1] - a).astype(np.int32), counts)
        np.subtract(ramp[: b - a], base, out=out[a:b])
    return pa.Array.from_buffers(pa.int32(), n_tokens, [None, pa.py_buffer(out)])


def arrow_gather(values: Any, starts: np.ndarray, lengths: np.ndarray, large: bool) -> Any:
    """Concatenate the runs ``values[starts[i]:starts[i] + lengths[i]]`` into one Arrow array.

    The fallback for value types the byte path cannot copy (see the module docstring): a
    list-view over ``values`` flattened by Arrow; older pyarrow (no list views) gets a
    per-token index ``take``.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    off_type = np.int64 if large else np.int32
    view_cls = getattr(pa, "LargeListViewArray" if large else "ListViewArray", None)
    if view_cls is not None:
        view = view_cls.from_arrays(
            pa.array(starts.astype(off_type)), pa.array(lengths.astype(off_type)), values
        )
        return view.flatten()
    bounds = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    index = np.arange(bounds[-1], dtype=np.int64)
    index += np.repeat(starts - bounds[:-1], lengths)
    return pc.take(values, pa.array(index))


# --------------------------------------------------------------------------------------------
# Output shards
# --------------------------------------------------------------------------------------------


def build_shard(
    cols: list[SourceColumn],
    pp: PackPlan,
    piece_bounds: np.ndarray,
    r0: int,
    r1: int,
    large: bool,
    names: list[str],
) -> Any:
    """Output rows ``[r0, r1)`` of the plan as one Arrow record batch."""
    import pyarrow as pa

    p0, p1 = int(pp.row_offsets[r0]), int(pp.row_offsets[r1])
    t0 = int(piece_bounds[p0])
    n = int(piece_bounds[p1]) - t0
    seq, start = pp.seq_index[p0:p1], pp.start[p0:p1]
    plen = pp.end[p0:p1] - start
    dst = piece_bounds[p0:p1] - t0
    shared_runs = None  # grouping for the columns read from a single buffer
    values = []
    for col in cols:
        if pp.strategy == "wrapped" and col.stream is not None:
            # The stream is the source itself: rows are slices of its values (zero-copy).
            values.append(col.stream.slice(col.stream_start + t0, n))
        elif col.width:
            if col.row_segment is not None:
                runs = Runs.of(plen, dst, pp.max_length, col.row_segment[seq])
            else:
                if shared_runs is None:
                    shared_runs = Runs.of(plen, dst, pp.max_length)
                runs = shared_runs
            values.append(copy_runs(col, runs, seq, start, n))
        elif col.row_start is not None:
            values.append(arrow_gather(col.stream, col.row_start[seq] + start, plen, large))
        else:
            raise ValueError(f"column {col.name!r} has no values to gather")
    if "position_ids" in names:
        values.append(position_ids(plen, dst, n))
    row_offsets = piece_bounds[pp.row_offsets[r0 : r1 + 1]] - t0
    list_cls = pa.LargeListArray if large else pa.ListArray
    row_offs = pa.array(row_offsets.astype(np.int64 if large else np.int32))
    arrays = [list_cls.from_arrays(row_offs, v) for v in values]
    arrays.append(
        pa.ListArray.from_arrays(
            pa.array((pp.row_offsets[r0 : r1 + 1] - p0).astype(np.int32)),
            pa.array(plen.astype(np.int32)),
        )
    )
    return pa.RecordBatch.from_arrays(arrays, names=names)


def write_stream(path: Path, batches: Iterator[Any]) -> None:
    """Write record batches to a new Arrow IPC stream file, one at a time (atomic rename)."""
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = None
    try:
        for batch in batches:
            if writer is None:
                writer = pa.ipc.new_stream(str(partial), batch.schema)
            writer.write_batch(batch)
            del batch
        if writer is None:
            raise ValueError(f"no record batches to write to {path}")
        writer.close()
        writer = None
        os.replace(partial, path)
    finally:
        if writer is not None:
            writer.close()
        partial.unlink(missing_ok=True)
