"""Invariants of the packing planner and packer (memlab.packing.core), on seeded random cases."""

from __future__ import annotations

import numpy as np
import pytest

from memlab.packing.core import STRATEGIES, PackPlan, apply, plan

SEEDS = (0, 1, 2, 3)
MAX_LENGTHS = (1, 7, 64, 2048)


def _random_lengths(seed: int, max_length: int) -> np.ndarray:
    """Lengths around and beyond ``max_length``: tiny, exact fits, overflow, zeros."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    kind = seed % 4
    if kind == 0:
        lens = rng.integers(1, 2 * max_length + 2, size=n)
    elif kind == 1:
        lens = np.clip(np.round(rng.lognormal(np.log(max(1, max_length // 4)), 1.0, n)), 0, None)
    elif kind == 2:
        lens = rng.choice([0, 1, max_length, max_length + 1, 3 * max_length], size=n)
    else:
        lens = rng.integers(0, max_length + 1, size=n)
    return lens.astype(np.int64)


EDGE_CASES = {
    "empty": [],
    "all_zero": [0, 0, 0],
    "exact": [8, 8, 8],
    "ones": [1] * 21,
    "all_longer": [9, 17, 30, 100],
    "single_long": [45],
    "mixed": [8, 1, 0, 7, 9, 2, 6, 3, 5, 4],
}


def _check_plan(p: PackPlan, lens: np.ndarray, max_length: int, strategy: str) -> None:
    """Every invariant a plan must satisfy, whatever the strategy."""
    lens = np.asarray(lens, dtype=np.int64)
    n_pieces = p.seq_index.shape[0]
    assert p.max_length == max_length and p.strategy == strategy
    assert p.start.shape == p.end.shape == (n_pieces,)
    offs = p.row_offsets
    assert offs[0] == 0 and offs[-1] == n_pieces and np.all(np.diff(offs) >= 1)
    # Pieces are non-empty slices of their source sequence, no longer than a row.
    if n_pieces:
        assert np.all(p.start >= 0) and np.all(p.end > p.start)
        assert np.all(p.end <= lens[p.seq_index])
        assert np.all(p.end - p.start <= max_length)
    # Rows are within capacity and add up.
    row_lens = p.row_lengths()
    assert row_lens.shape == (p.num_rows,)
    assert np.all(row_lens >= 1) and np.all(row_lens <= max_length)
    assert int(row_lens.sum()) == p.tokens_out
    assert p.tokens_in == int(lens.sum())
    if p.num_rows:
        assert p.fill_ratio == pytest.approx(p.tokens_out / (p.num_rows * max_length))
    else:
        assert p.fill_ratio == 0.0
    # Each source token appears at most once: pieces of a sequence are disjoint; sorted by
    # (seq, start) each one starts where the previous ended (or at 0 for the first).
    order = np.lexsort((p.start, p.seq_index))
    seq, start, end = p.seq_index[order], p.start[order], p.end[order]
    first = np.ones(n_pieces, dtype=bool)
    first[1:] = seq[1:] != seq[:-1]
    assert np.all(start[first] == 0)
    assert np.all(start[~first] == end[np.flatnonzero(~first) - 1])
    covered = np.zeros(lens.shape[0], dtype=np.int64)
    np.add.at(covered, seq, end - start)
    overflow = np.maximum(lens - max_length, 0)
    if strategy == "bfd":
        assert np.all(covered == np.minimum(lens, max_length))
        assert np.array_equal(np.unique(p.seq_index), np.flatnonzero(lens > 0))
        assert p.tokens_dropped == int(overflow.sum())
    else:  # bfd_split, wrapped: every token exactly once
        assert np.all(covered == lens)
        assert p.tokens_dropped == 0
    if strategy == "bfd_split":  # chunks aligned on max_length
        assert np.all(p.start % max_length == 0)
        assert np.all(p.end == np.minimum(p.start + max_length, lens[p.seq_index]))
    if strategy == "wrapped":  # the stream, in order, cut into full rows
        assert np.all(row_lens[:-1] == max_length)
        assert np.all(np.diff(p.seq_index) >= 0)
        assert np.array_equal(order, np.arange(n_pieces))
    rows = p.rows()
    assert len(rows) == p.num_rows
    assert sum(len(r) for r in rows) == n_pieces


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("max_length", MAX_LENGTHS)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_plans_hold_invariants(strategy: str, max_length: int, seed: int) -> None:
    lens = _random_lengths(seed, max_length)
    _check_plan(plan(lens, max_length, strategy), lens, max_length, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_edge_cases(strategy: str, case: str) -> None:
    lens = np.asarray(EDGE_CASES[case], dtype=np.int64)
    p = plan(EDGE_CASES[case], 8, strategy)
    _check_plan(p, lens, 8, strategy)
    if case in ("empty", "all_zero"):
        assert p.num_rows == 0 and p.num_pieces == 0 and p.fill_ratio == 0.0
    if case == "exact":
        assert p.rows() == [[(0, 0, 8)], [(1, 0, 8)], [(2, 0, 8)]]
        assert p.fill_ratio == 1.0
    if case == "ones":
        assert p.row_lengths().tolist() == [8, 8, 5]
    if case == "all_longer" and strategy == "bfd":
        assert p.num_rows == 4 and p.fill_ratio == 1.0 and p.tokens_dropped == 156 - 32


def test_docstring_example_matches_trl_semantics() -> None:
    """The example of the module docstring (same as TRL's ``pack_dataset`` docstring)."""
    lens = [5, 2, 3, 1]
    assert plan(lens, 4, "bfd").rows() == [[(0, 0, 4)], [(2, 0, 3), (3, 0, 1)], [(1, 0, 2)]]
    assert plan(lens, 4, "bfd_split").rows() == [
        [(0, 0, 4)],
        [(2, 0, 3), (0, 4, 5)],
        [(1, 0, 2), (3, 0, 1)],
    ]
    assert plan(lens, 4, "wrapped").rows() == [
        [(0, 0, 4)],
        [(0, 4, 5), (1, 0, 2), (2, 0, 1)],
        [(2, 1, 3), (3, 0, 1)],
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deterministic(strategy: str) -> None:
    lens = _random_lengths(5, 64)
    a = plan(lens, 64, strategy)
    b = plan(lens.tolist(), 64, strategy)  # list input, same answer
    c = plan(lens.astype(np.int32), 64, strategy)
    for other in (b, c):
        for field in ("seq_index", "start", "end", "row_offsets"):
            assert np.array_equal(getattr(a, field), getattr(other, field))


def _processing_order(p: PackPlan) -> np.ndarray:
    """Pieces in the order BFD places them: longest first, then by sequence, then offset."""
    return np.lexsort((p.start, p.seq_index, -(p.end - p.start)))


def _row_of_piece(p: PackPlan) -> np.ndarray:
    return np.repeat(np.arange(p.num_rows), np.diff(p.row_offsets))


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("max_length", [7, 16, 50])
def test_best_fit_property_by_brute_force(strategy: str, seed: int, max_length: int) -> None:
    """Replay the placements: each piece went to the fullest row that fit, else a new row."""
    lens = _random_lengths(seed, max_length)[:150]
    p = plan(lens, max_length, strategy)
    row_of = _row_of_piece(p)
    plen = p.end - p.start
    caps: list[int] = []
    for piece in _processing_order(p):
        length, row = int(plen[piece]), int(row_of[piece])
        fitting = [c for c in caps if c >= length]
        if fitting:
            assert row < len(caps), "opened a new row although an existing one fits"
            assert caps[row] == min(fitting), "not the best (smallest) fitting row"
        else:
            assert row == len(caps), "rows must be opened in order"
            caps.append(max_length)
        caps[row] -= length


def _reference_bfd(lens: np.ndarray, max_length: int, split: bool) -> list[list[tuple]]:
    """One piece at a time, O(n * rows): best fit, ties to the row that got its capacity first."""
    pieces = []
    for i, n in enumerate(lens.tolist()):
        if split:
            pieces += [(i, s, min(s + max_length, n)) for s in range(0, n, max_length)]
        elif n:
            pieces.append((i, 0, min(n, max_length)))
    pieces.sort(key=lambda t: (-(t[2] - t[1]), t[0], t[1]))
    rows: list[list[tuple]] = []
    state: list[tuple[int, int]] = []  # (remaining capacity, time it got that capacity)
    for clock, piece in enumerate(pieces):
        length = piece[2] - piece[1]
        fits = [(cap, stamp, r) for r, (cap, stamp) in enumerate(state) if cap >= length]
        if fits:
            r = min(fits)[2]
        else:
            r = len(rows)
            rows.append([])
            state.append((max_length, -1))
        rows[r].append(piece)
        state[r] = (state[r][0] - length, clock)
    return rows


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_bulk_bfd_equals_one_at_a_time_bfd(split: bool, seed: int) -> None:
    """The grouped/bulk placement gives exactly the classic per-piece BFD (FIFO ties)."""
    max_length = [5, 16, 33, 100][seed % 4]
    lens = _random_lengths(seed, max_length)[:250]
    strategy = "bfd_split" if split else "bfd"
    assert plan(lens, max_length, strategy).rows() == _reference_bfd(lens, max_length, split)


def test_bfd_fill_ratio_heavy_tailed() -> None:
    rng = np.random.default_rng(1234)
    lens = np.clip(np.round(rng.lognormal(np.log(300), 1.0, 20_000)), 1, 16_384).astype(int)
    assert lens.max() > 4000  # the tail reaches several thousand tokens
    for strategy in ("bfd", "bfd_split"):
        p = plan(lens, 2048, strategy)
        _check_plan(p, lens, 2048, strategy)
        assert p.fill_ratio >= 0.95, (strategy, p.fill_ratio)


@pytest.mark.parametrize(
    ("lengths", "max_length", "strategy", "error"),
    [
        ([1, -1], 4, "bfd", ValueError),
        ([1.5, 2.0], 4, "bfd", TypeError),
        ([[1, 2]], 4, "bfd", ValueError),
        ([1, 2], 0, "bfd", ValueError),
        ([1, 2], 4, "first_fit", ValueError),
    ],
)
def test_plan_rejects_bad_input(lengths, max_length, strategy, error) -> None:
    with pytest.raises(error):
        plan(lengths, max_length, strategy)


# ---------------------------------------------------------------------------------------------
# apply() on a datasets.Dataset
# ---------------------------------------------------------------------------------------------

STRIDE = 100_000  # token value = seq * STRIDE + offset: every token says where it came from


def _mask_of(tokens: np.ndarray) -> np.ndarray:
    return ((tokens * 7 + tokens // STRIDE) % 3 == 0).astype(np.int8)


def _token_dataset(lens: list[int]):
    datasets = pytest.importorskip("datasets")
    ids = [[i * STRIDE + t for t in range(n)] for i, n in enumerate(lens)]
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids,
            "completion_mask": [_mask_of(np.asarray(x, dtype=np.int64)).tolist() for x in ids],
            "labels": [[-t for t in x] for x in ids],
            "source": [f"doc{i}" for i in range(len(lens))],
        }
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("max_length", [1, 16, 50])
def test_apply_packs_aligned_rows(strategy: str, max_length: int) -> None:
    rng = np.random.default_rng(max_length)
    lens = rng.integers(0, 3 * max_length, size=60).tolist() + [max_length, 1]
    ds = _token_dataset(lens)
    cols = ("input_ids", "completion_mask", "labels")
    packed, stats = apply(ds, max_length, strategy, columns=cols)
    p = plan(lens, max_length, strategy)

    assert packed.column_names == [*cols, "position_ids", "seq_lengths"]  # "source" dropped
    assert len(packed) == stats.rows == p.num_rows
    assert stats.sequences == len(lens)
    assert stats.tokens_in == sum(lens)
    assert stats.tokens_out == p.tokens_out == stats.tokens_in - stats.tokens_dropped
    assert stats.fill_ratio == pytest.approx(p.fill_ratio)
    assert stats.seconds >= 0

    got: dict[int, list[int]] = {}
    for row in packed:
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        seq_lengths = row["seq_lengths"]
        assert 1 <= len(ids) <= max_length
        assert sum(seq_lengths) == len(ids) == len(row["position_ids"])
        # position_ids restart at 0 at each piece and count up within it.
        expected_pos = np.concatenate([np.arange(n) for n in seq_lengths])
        assert np.array_equal(row["position_ids"], expected_pos)
        # Per-token columns stay aligned with their tokens.
        assert np.array_equal(row["completion_mask"], _mask_of(ids))
        assert np.array_equal(row["labels"], -ids)
        # Each piece is one contiguous run of one source sequence.
        bounds = np.cumsum([0, *seq_lengths])
        for a, b in zip(bounds[:-1], bounds[1:]):
            piece = ids[a:b]
            assert np.all(piece // STRIDE == piece[0] // STRIDE)
            assert np.array_equal(np.diff(piece), np.ones(b - a - 1))
        for tok in ids.tolist():
            got.setdefault(tok // STRIDE, []).append(tok % STRIDE)

    # Reassemble: every sequence comes back (bfd: its first max_length tokens), each token once.
    for i, n in enumerate(lens):
        keep = min(n, max_length) if strategy == "bfd" else n
        assert sorted(got.get(i, [])) == list(range(keep))
    if strategy == "wrapped":  # the stream order is kept too
        flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in packed["input_ids"]])
        assert np.array_equal(
            flat, np.concatenate([np.arange(n) + i * STRIDE for i, n in enumerate(lens)])
        )


def test_apply_keeps_dtypes_and_respects_indices() -> None:
    lens = [5, 2, 3, 1, 0, 9]
    ds = _token_dataset(lens).shuffle(seed=3).select(range(5))  # an indices mapping
    keep = ds["input_ids"]
    packed, stats = apply(ds, 4, "bfd_split", columns=("input_ids", "completion_mask"))
    assert stats.tokens_in == sum(len(x) for x in keep)
    assert stats.tokens_dropped == 0
    assert sorted(t for r in packed["input_ids"] for t in r) == sorted(t for x in keep for t in x)
    assert packed.features["input_ids"].feature.dtype == ds.features["input_ids"].feature.dtype
    assert packed.features["completion_mask"].feature.dtype == "int64"  # from_dict default
    assert packed.features["position_ids"].feature.dtype == "int32"


def test_apply_empty_and_errors() -> None:
    datasets = pytest.importorskip("datasets")
    empty = datasets.Dataset.from_dict({"input_ids": [[], []]})
    packed, stats = apply(empty, 8, "bfd")
    assert len(packed) == 0 and stats.rows == 0 and stats.tokens_in == 0
    assert packed.column_names == ["input_ids", "position_ids", "seq_lengths"]

    bad = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "mask": [[1], [1]]})
    with pytest.raises(ValueError, match="mask"):
        apply(bad, 8, "bfd", columns=("input_ids", "mask"))
    with pytest.raises(KeyError):
        apply(bad, 8, "bfd", columns=("nope",))
    with pytest.raises(TypeError):
        apply(datasets.Dataset.from_dict({"input_ids": [1, 2]}), 8, "bfd")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_apply_without_list_views_gives_same_rows(strategy: str, monkeypatch) -> None:
    """The numpy gather fallback (pyarrow without list views) packs identically."""
    pa = pytest.importorskip("pyarrow")
    ds = _token_dataset([5, 0, 17, 3, 40, 1, 16, 9])
    cols = ("input_ids", "completion_mask")
    fast, _ = apply(ds, 16, strategy, columns=cols)
    monkeypatch.delattr(pa, "ListViewArray")
    slow, _ = apply(ds, 16, strategy, columns=cols)
    assert fast.to_dict() == slow.to_dict()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_max_length_beyond_16_bits(strategy: str) -> None:
    """Capacities over 65535 take the non-radix sort path and still plan exactly."""
    max_length = 70_000
    lens = np.random.default_rng(9).integers(0, 3 * max_length, size=60)
    p = plan(lens, max_length, strategy)
    _check_plan(p, lens, max_length, strategy)
    if strategy != "wrapped":
        assert p.rows() == _reference_bfd(lens, max_length, split=strategy == "bfd_split")
