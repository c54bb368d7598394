"""What the loop trains on: one micro-batch (:class:`Batch`) and the deterministic, resumable,
rank-sharded stream of them (:class:`BatchStream`).

Methods build batches (their ``collate``); the trainer moves, measures and steps over them.
A batch's ``tensors`` may also carry host-side values that describe the tensors (for example
the per-document segments of packed rows, :class:`memlab.trainer.batch.Segments`): they travel
with the batch, are never moved to a device, and are passed to the model like keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


class Segments(tuple):
    """Per row, the documents that share it (a packed / padding-free row), in order, their
    lengths summing to the row's width. Computed once per batch by the collator on the host, so
    attention that runs per document needs no device-to-host read at every layer.

    A row is a tuple of entries, one per document: ``n`` (an int) is a plain document of ``n``
    tokens (causal attention inside it, nothing outside it); ``(n, a, b)`` is a document of
    ``n`` tokens that also sees the row's tokens ``[a, b)``, which lie before it: every one of
    its tokens attends to all of ``[a, b)`` and causally to its own document. That expresses a
    shared prefix (a preference pair's prompt stored once: the chosen tokens continue the prompt
    as one plain document, the rejected tokens are a document that also sees the prompt, and not
    the chosen tokens). Only plain ints and tuples are stored, so the structure survives being
    copied as a plain nested tuple (:meth:`of` restores the class)."""

    __slots__ = ()

    @classmethod
    def of(cls, value) -> Segments:
        """``value`` as Segments (a plain nested tuple, e.g. after a wrapper copied it)."""
        return value if isinstance(value, Segments) else cls(tuple(r) for r in value)

    @classmethod
    def from_lengths(cls, rows: list[list[int]]) -> Segments:
        """Per row, its documents' lengths (a packed row's ``seq_lengths``, then any pad tail)."""
        return cls(tuple(int(n) for n in row if n) for row in rows)

    def positions(self) -> list[list[int]]:
        """Position ids restarting at every document (what packed rows feed the model); a
        document that also sees a prefix ``[a, b)`` continues it (from ``b - a``), as the
        completion after a shared prompt does."""
        def run(e: int | tuple[int, int, int]) -> range:
            return range(e) if isinstance(e, int) else range(e[2] - e[1], e[2] - e[1] + e[0])

        return [[t for e in row for t in run(e)] for row in self]

    @classmethod
    def from_positions(cls, positions: list[list[int]]) -> Segments:
        """Split every row (of ``[rows, T]`` position ids) where its position ids do not
        continue (``p[t] != p[t-1] + 1``)."""
        out = []
        for row in positions:
            lengths: list[int] = []
            n = 0
            for t, p in enumerate(row):
                if t and p != row[t - 1] + 1:
                    lengths.append(n)
                    n = 0
                n += 1
            if n:
                lengths.append(n)
            out.append(tuple(lengths))
        return cls(out)

    @staticmethod
    def length(entry: int | tuple[int, int, int]) -> int:
        """Tokens of one document entry."""
        return entry if isinstance(entry, int) else entry[0]

    def bounds(self, row: int) -> list[tuple[int, int]]:
        """``(start, end)`` of each document of ``row``."""
        out, start = [], 0
        for entry in self[row]:
            n = self.length(entry)
            out.append((start, start + n))
            start += n
        return out

    def shares_prefixes(self) -> bool:
        """Whether any document also sees a prefix (False: plain documents only)."""
        return any(not isinstance(e, int) for row in self for e in row)

    def documents(self, row: int) -> list[tuple[int, int, tuple[int, int] | None]]:
        """``(start, end, prefix)`` of each document of ``row``; ``prefix`` is the ``(a, b)``
        token range it also sees, or None."""
        out: list[tuple[int, int, tuple[int, int] | None]] = []
        start = 0
        for entry in self[row]:
            if isinstance(entry, int):
                out.append((start, start + entry, None))
                start += entry
            else:
                n, a, b = entry
                if not 0 <= a < b <= start:
                    raise ValueError(f"row {row}: a document at {start} cannot see [{a}, {b}); "
                                     "a shared prefix lies before the document")
                out.append((start, start + n, (a, b)))
                start += n
        return out


@dataclass
class Batch:
    """Tensors for one micro-batch plus what the trainer needs to normalise and measure."""

    tensors: dict[str, Any]
    """Model inputs and targets (tensors), plus host-side descriptions of them (``Segments``)."""
    num_items: int
    """Loss normaliser contributed by this micro-batch (loss tokens, pairs, examples)."""
    real_tokens: int
    """Tokens that are not padding (what tokens/s counts)."""
    total_tokens: int
    """Token slots including padding."""
    size_key: tuple[int, ...] = ()
    """Shape signature; a batch with a larger key may reach a higher memory peak."""
    meta: dict[str, Any] = field(default_factory=dict)

    def to(self, device: str) -> Batch:
        self.tensors = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                        for k, v in self.tensors.items()}
        return self

    def tensor_list(self) -> list[torch.Tensor]:
        """The batch's tensors (not its host-side values)."""
        return [v for v in self.tensors.values() if isinstance(v, torch.Tensor)]


class BatchStream:
    """Deterministic, resumable stream of micro-batches: a seeded permutation per epoch.

    With ``shard=(rank, world_size)`` every rank walks the same permutation in global batches
    of ``batch_size * world_size`` rows and collates its own slice of each, so N ranks x batch
    B see exactly the rows one process sees with batch N*B."""

    def __init__(self, ds, batch_size: int, seed: int, collate: Callable[[list[dict]], Batch],
                 shard: tuple[int, int] = (0, 1)):
        if len(ds) == 0:
            raise ValueError("the prepared dataset is empty (every example was dropped?)")
        self.ds, self.batch_size, self.seed, self.collate = ds, batch_size, seed, collate
        self.rank, self.world = shard
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.ds), generator=g).tolist()

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation(self.epoch)

    def at_epoch_end(self) -> bool:
        """Whether this pass's rows are all taken (the next micro-batch starts a new pass)."""
        return self.pos >= len(self._perm)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def next_indices(self) -> list[int]:
        """Dataset rows of the next micro-batch (this rank's slice), without taking it."""
        if self.pos >= len(self._perm):
            self.epoch += 1
            self.pos = 0
            self._perm = self._permutation(self.epoch)
        idx = self._perm[self.pos : self.pos + self.batch_size * self.world]
        if self.world > 1:  # this rank's slice; a short last batch is split as evenly
            per = -(-len(idx) // self.world)
            idx = idx[self.rank * per : (self.rank + 1) * per] or idx[-1:]
        return idx

    def __next__(self) -> Batch:
        idx = self.next_indices()
        self.pos += min(self.batch_size * self.world, len(self._perm) - self.pos)
        cols = self.ds[idx]
        rows = [{k: cols[k][i] for k in cols} for i in range(len(idx))]
        return self.collate(rows)
