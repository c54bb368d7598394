"""Packing units that must stay together: preference pairs (``dpo``, ``reward``), KTO examples
with their KL partner. A group-aware planner next to :mod:`memlab.packing.core` (which packs
independent sequences).

A *unit* is what one loss term needs together: a pair's chosen and rejected sequences, a KTO
example and its mismatched KL sequence. The method states two sizes per unit (through
:class:`GroupPacked`): ``whole``, the tokens of the unit laid out in one row (with a shared
prompt counted once when ``method.share_prompt``), and ``pieces``, the tokens of each of its
sequences on its own (``prompt + completion``, each within the method's own limits).

The output is a list of *packs*. A pack is one micro-batch: at most ``rows_per_pack`` rows
(``train.batch_size``) of at most ``capacity`` tokens (``method.max_length``). Every unit
lands in exactly one pack, so its sequences are always in the same micro-batch:

* ``bfd``: every unit is placed whole in one row (the method has already cut units that did not
  fit, by its own truncation rules). Units are taken largest first (ties: lower index first)
  and each goes into the open row with the smallest room that still fits it (best fit, over
  the rows of every pack); a unit that fits no open row opens a row in the first pack with a
  free row slot, or a new pack.
* ``bfd_split``: a unit that fits one row is placed as in ``bfd``. A unit larger than a row is
  split into its pieces (its sequences, never cut further), which go into rows of ONE pack:
  such units are placed first, largest piece first, each piece best-fit into the rows of the
  current pack (opening rows there while it has free slots); when the current pack cannot take
  all of a unit's pieces, a new pack is opened for it. Then the whole units fill every row's
  remaining room as in ``bfd``. No token is lost.

Each pack records its units in placement order and, per unit, the row of each of its pieces
(one row for a whole unit). The collator lays the rows out from that: a row holds the documents
of its units in that order.

:func:`apply` turns a prepared dataset (one unit per row) into a dataset of packs: one item per
micro-batch, each column holding the list of its units' values, plus ``pack_rows``.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memlab.protocols import GroupPacked as GroupPacked  # the capability (re-exported here)

PACK_ROWS = "pack_rows"
"""The column of a packed dataset that holds, per unit, the row of each of its pieces."""


@dataclass(frozen=True)
class GroupPlan:
    """Packs of units: ``packs[k]`` lists ``(unit, rows)`` in placement order, ``rows`` the row
    (within the pack) of each piece, one entry for a unit placed whole."""

    packs: list[list[tuple[int, tuple[int, ...]]]]
    rows: int
    capacity: int
    rows_per_pack: int
    tokens_out: int
    """Tokens stored in rows (a split unit's shared prompt counts once per piece)."""
    split_units: int

    @property
    def fill_ratio(self) -> float:
        """Tokens stored / (rows * capacity)."""
        return self.tokens_out / (self.rows * self.capacity) if self.rows else 0.0

    def row_lengths(self, whole: Sequence[int], pieces: Sequence[Sequence[int]]
                    ) -> list[list[int]]:
        """Tokens of every row of every pack (for checks and tests)."""
        out = []
        for pack in self.packs:
            n = 1 + max(r for _, rows in pack for r in rows)
            lengths = [0] * n
            for u, rows in pack:
                if len(rows) == 1:  # placed whole
                    lengths[rows[0]] += whole[u]
                else:
                    for r, size in zip(rows, pieces[u], strict=True):
                        lengths[r] += size
            out.append(lengths)
        return out


class _Rows:
    """Open rows of every pack, bucketed by remaining room (best fit in O(log capacity))."""

    def __init__(self, capacity: int, rows_per_pack: int):
        self.capacity, self.per_pack = capacity, rows_per_pack
        self.buckets: dict[int, deque[tuple[int, int]]] = {}
        self.rooms: list[int] = []  # sorted keys of non-empty buckets
        self.used: list[int] = []  # rows opened per pack
        self.free: deque[int] = deque()  # packs with a free row slot, in order

    def new_pack(self) -> int:
        self.used.append(0)
        self.free.append(len(self.used) - 1)
        return len(self.used) - 1

    def open_row(self, pack: int | None = None) -> tuple[int, int]:
        """A new empty row, in ``pack`` or in the first pack with a free slot."""
        if pack is None:
            while self.free and self.used[self.free[0]] >= self.per_pack:
                self.free.popleft()
            pack = self.free[0] if self.free else self.new_pack()
        row = self.used[pack]
        self.used[pack] += 1
        return pack, row

    def put(self, room: int, where: tuple[int, int]) -> None:
        if room <= 0:
            return
        if room not in self.buckets:
            self.buckets[room] = deque()
            bisect.insort(self.rooms, room)
        self.buckets[room].append(where)

    def best_fit(self, size: int) -> tuple[int, int, int] | None:
        """The open row with the smallest room >= ``size`` (FIFO among equals), removed:
        ``(pack, row, room)``."""
        i = bisect.bisect_left(self.rooms, size)
        if i == len(self.rooms):
            return None
        room = self.rooms[i]
        bucket = self.buckets[room]
        pack, row = bucket.popleft()
        if not bucket:
            del self.buckets[room]
            del self.rooms[i]
        return pack, row, room


def _check(whole: Sequence[int], pieces: Sequence[Sequence[int]], capacity: int,
           rows_per_pack: int, split: bool) -> None:
    if capacity < 1 or rows_per_pack < 1:
        raise ValueError(f"capacity and rows_per_pack must be >= 1 (got {capacity}, "
                         f"{rows_per_pack})")
    if len(whole) != len(pieces):
        raise ValueError(f"{len(whole)} unit sizes but {len(pieces)} piece lists")
    for u, (w, ps) in enumerate(zip(whole, pieces, strict=True)):
        if w < 1 or not ps or min(ps) < 0:
            raise ValueError(f"unit {u}: sizes must be positive (whole {w}, pieces {list(ps)})")
        if w <= capacity:
            continue
        if not split:
            raise ValueError(f"unit {u} has {w} tokens, more than a row's {capacity}: the method "
                             "must fit units to the row before bfd packs them")
        if max(ps) > capacity or len(ps) > rows_per_pack:
            raise ValueError(f"unit {u} cannot be split into rows of {capacity} tokens, "
                             f"{rows_per_pack} per micro-batch (pieces {list(ps)})")


def plan(whole: Sequence[int], pieces: Sequence[Sequence[int]], capacity: int,
         rows_per_pack: int, split: bool) -> GroupPlan:
    """Plan packs of units (module docstring). ``split``: ``bfd_split`` (else ``bfd``).
    Identical inputs give identical plans."""
    _check(whole, pieces, capacity, rows_per_pack, split)
    rows = _Rows(capacity, rows_per_pack)
    packs: list[list[tuple[int, tuple[int, ...]]]] = []
    tokens = 0

    def place(pack: int, unit: int, where: tuple[int, ...]) -> None:
        while len(packs) <= pack:
            packs.append([])
        packs[pack].append((unit, where))

    # split units first, largest piece first, into the rows of the current pack
    big = sorted((u for u, w in enumerate(whole) if w > capacity),
                 key=lambda u: (-max(pieces[u]), u))
    current: int | None = None
    current_rooms: dict[int, int] = {}  # row -> room, rows of the current pack
    for u in big:
        fit = _fit_in_pack(pieces[u], current_rooms, rows, current) if current is not None \
            else None
        if current is None or fit is None:
            if current is not None:  # hand the old pack's rows over to the whole units
                for r, room in current_rooms.items():
                    rows.put(room, (current, r))
            current, current_rooms = rows.new_pack(), {}
            fit = _fit_in_pack(pieces[u], current_rooms, rows, current)
            if fit is None:  # _check makes sure every split unit fits an empty pack
                raise ValueError(f"unit {u} (pieces {list(pieces[u])}) does not fit an empty "
                                 "pack")
        place(current, u, fit)
        tokens += sum(pieces[u])
    if current is not None:
        for r, room in current_rooms.items():
            rows.put(room, (current, r))

    # whole units: best fit over every open row, largest first
    small = sorted((u for u, w in enumerate(whole) if w <= capacity), key=lambda u: (-whole[u], u))
    for u in small:
        size = whole[u]
        hit = rows.best_fit(size)
        if hit is None:
            pack, row = rows.open_row()
            room = capacity
        else:
            pack, row, room = hit
        rows.put(room - size, (pack, row))
        place(pack, u, (row,))
        tokens += size
    return GroupPlan(packs=packs, rows=sum(rows.used), capacity=capacity,
                     rows_per_pack=rows_per_pack, tokens_out=tokens, split_units=len(big))


def _fit_in_pack(sizes: Sequence[int], rooms: dict[int, int], rows: _Rows, pack: int
                 ) -> tuple[int, ...] | None:
    """Best fit of every piece into the pack's rows (opening rows while it has free slots);
    ``rooms`` is updated only when all pieces fit. Returns the row of each piece."""
    trial = dict(rooms)
    opened = 0
    where = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        options = [(room, r) for r, room in trial.items() if room >= sizes[i]]
        if options:
            room, r = min(options)
        elif rows.used[pack] + opened < rows.per_pack:
            r = rows.used[pack] + opened
            opened += 1
            room = rows.capacity
        else:
            return None
        trial[r] = room - sizes[i]
        where[i] = r
    for _ in range(opened):
        rows.open_row(pack)
    rooms.clear()
    rooms.update(trial)
    return tuple(where)


@dataclass(frozen=True)
class GroupStats:
    """Summary of one :func:`apply` call."""

    packs: int
    rows: int
    fill_ratio: float
    split_units: int
    seconds: float


def apply(ds, whole: Sequence[int], pieces: Sequence[Sequence[int]], capacity: int,
          rows_per_pack: int, split: bool) -> tuple[Any, GroupStats]:
    """Pack a prepared dataset (one unit per row): one output item per pack, each column the
    list of its units' values in placement order, plus :data:`PACK_ROWS` (per unit, the row of
    each piece)."""
    import datasets

    t0 = time.perf_counter()
    p = plan(whole, pieces, capacity, rows_per_pack, split)
    cols = ds[:]
    out: dict[str, list] = {c: [] for c in ds.column_names}
    out[PACK_ROWS] = []
    for pack in p.packs:
        units = [u for u, _ in pack]
        for c in ds.column_names:
            out[c].append([cols[c][u] for u in units])
        out[PACK_ROWS].append([list(rows) for _, rows in pack])
    key = repr((getattr(ds, "_fingerprint", None), "memlab.packing.groups", capacity,
                rows_per_pack, split))
    table = datasets.table.InMemoryTable.from_pydict(out)
    packed = datasets.Dataset(table, fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16])
    stats = GroupStats(packs=len(p.packs), rows=p.rows, fill_ratio=p.fill_ratio,
                       split_units=p.split_units, seconds=time.perf_counter() - t0)
    return packed, stats
