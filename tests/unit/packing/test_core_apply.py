"""apply() builds exactly the rows its plan describes, whatever the column types, the Arrow
layout of the source (slices, chunks, memory-mapped files) and the output sharding."""

from __future__ import annotations

import numpy as np
import pytest

from memlab.packing import _arrow
from memlab.packing.core import STRATEGIES, apply, plan

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

COLS = ("input_ids", "labels", "weights", "keep")


def _lengths(seed: int, n: int = 80, max_length: int = 16) -> list[int]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 3 * max_length, size=n)
    lens[rng.integers(0, n, size=5)] = 0  # empty sequences produce no piece
    return [*lens.tolist(), max_length, 1]


def _table(lens: list[int], seed: int = 0, large: bool = False):
    """int32 ids, int64 labels, float32 weights, bool keep (Arrow's fallback path) per token."""
    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    n = int(offsets[-1])
    cls = pa.LargeListArray if large else pa.ListArray
    off = pa.array(offsets if large else offsets.astype(np.int32))
    values = {
        "input_ids": pa.array(np.arange(n, dtype=np.int32) * 3 + 1),
        "labels": pa.array(-np.arange(n, dtype=np.int64)),
        "weights": pa.array(rng.random(n, dtype=np.float32)),
        "keep": pa.array(rng.random(n) < 0.5),
    }
    return pa.table({k: cls.from_arrays(off, v) for k, v in values.items()})


def _dataset(lens: list[int], **kw):
    return datasets.Dataset(datasets.table.InMemoryTable(_table(lens, **kw)))


def _expected(rows: dict[str, list], lens: list[int], max_length: int, strategy: str) -> dict:
    """The packed rows, assembled in Python from the plan."""
    p = plan(lens, max_length, strategy)
    out: dict[str, list] = {c: [] for c in [*rows, "position_ids", "seq_lengths"]}
    for pieces in p.rows():
        for c in rows:
            out[c].append([v for s, a, b in pieces for v in rows[c][s][a:b]])
        out["position_ids"].append([i for _, a, b in pieces for i in range(b - a)])
        out["seq_lengths"].append([b - a for _, a, b in pieces])
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_apply_equals_python_reference_for_every_column_type(strategy: str, seed: int) -> None:
    lens = _lengths(seed)
    ds = _dataset(lens, seed=seed)
    packed, stats = apply(ds, 16, strategy, columns=COLS)
    assert packed.to_dict() == _expected(ds.to_dict(), lens, 16, strategy)
    assert stats.rows == len(packed) == plan(lens, 16, strategy).num_rows


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_value_types_are_kept(strategy: str) -> None:
    """int32 stays int32 (no widening), and so do int64, float32 and bool."""
    packed, _ = apply(_dataset(_lengths(3)), 16, strategy, columns=COLS)
    types = {f.name: f.type.value_type for f in packed.data.schema}
    assert types == {
        "input_ids": pa.int32(),
        "labels": pa.int64(),
        "weights": pa.float32(),
        "keep": pa.bool_(),
        "position_ids": pa.int32(),
        "seq_lengths": pa.int32(),
    }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_large_list_input_and_sliced_source(strategy: str) -> None:
    """A large_list source, and a contiguous select (an Arrow slice: offsets not at 0)."""
    lens = _lengths(4)
    ds = _dataset(lens, large=True).select(range(7, 60))
    assert ds._indices is None  # a plain slice of the table, not an indices mapping
    packed, _ = apply(ds, 16, strategy, columns=COLS)
    assert packed.to_dict() == _expected(ds.to_dict(), lens[7:60], 16, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_chunked_sources_pack_like_one_chunk(strategy: str, tmp_path, monkeypatch) -> None:
    """Chunks in separate buffers, the record batches of one memory-mapped file, a dataset
    saved as several files, and chunks joined into one array first all give the rows that one
    chunk gives."""
    lens = _lengths(5)
    whole = _dataset(lens)
    ref, _ = apply(whole, 16, strategy, columns=COLS)
    table = whole.data.table
    copies = [pa.table(t.to_pydict(), schema=table.schema) for t in (table[:40], table[40:])]
    halves = datasets.Dataset(datasets.table.InMemoryTable(pa.concat_tables(copies)))
    assert halves.data.column("input_ids").num_chunks == 2
    whole.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    files = datasets.load_from_disk(str(tmp_path / "saved"))
    mapped = files.map(lambda b: b, batched=True, batch_size=9, writer_batch_size=9,
                       cache_file_name=str(tmp_path / "mapped.arrow"))
    assert mapped.data.column("input_ids").num_chunks > 5

    def segments(ds) -> int:
        column = _arrow.read_column(ds.data.column("input_ids"), "input_ids")
        return len(column.segments) if column.stream is None else 0  # 0: one Arrow array

    assert (segments(halves), segments(files), segments(mapped)) == (2, 3, 1)
    for other in (halves, files, mapped):
        packed, _ = apply(other, 16, strategy, columns=COLS)
        assert packed.to_dict() == ref.to_dict()
    monkeypatch.setattr(_arrow, "_MAX_SEGMENTS", 2)  # three files: joined into one array
    assert segments(files) == 0
    assert apply(files, 16, strategy, columns=COLS)[0].to_dict() == ref.to_dict()


def test_indices_mapping_is_applied() -> None:
    lens = _lengths(6)
    ds = _dataset(lens).shuffle(seed=1).select(range(50))
    assert ds._indices is not None
    kept = [len(x) for x in ds["input_ids"]]
    for strategy in STRATEGIES:
        packed, _ = apply(ds, 16, strategy, columns=COLS)
        assert packed.to_dict() == _expected(ds.to_dict(), kept, 16, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_apply_equals_one_shot(strategy: str, tmp_path) -> None:
    lens = _lengths(7, n=150)
    ds = _dataset(lens)
    ref, ref_stats = apply(ds, 16, strategy, columns=COLS)
    for shard_rows in (1, 7, 10_000):
        packed, stats = apply(ds, 16, strategy, columns=COLS, shard_rows=shard_rows)
        assert packed.data.column("input_ids").num_chunks == -(-len(ref) // shard_rows)
        assert packed.to_dict() == ref.to_dict()
        assert stats.rows == ref_stats.rows and stats.tokens_out == ref_stats.tokens_out
    path = tmp_path / "out" / "packed.arrow"
    on_disk, _ = apply(ds, 16, strategy, columns=COLS, shard_rows=7, output_path=path)
    assert isinstance(on_disk.data, datasets.table.MemoryMappedTable)
    assert on_disk.data.column("input_ids").num_chunks == -(-len(ref) // 7)
    assert on_disk.to_dict() == ref.to_dict()
    assert on_disk.features == ref.features
    assert [p.name for p in path.parent.iterdir()] == ["packed.arrow"]  # no partial file left
    with pytest.raises(FileExistsError, match="already exists"):
        apply(ds, 16, strategy, columns=COLS, output_path=path)


def test_output_path_default_shards_and_empty_output(tmp_path) -> None:
    lens = _lengths(8)
    ds = _dataset(lens)
    packed, _ = apply(ds, 16, "bfd", columns=("input_ids",), output_path=tmp_path / "a.arrow")
    assert packed.to_dict() == apply(ds, 16, "bfd", columns=("input_ids",))[0].to_dict()
    empty = datasets.Dataset.from_dict({"input_ids": [[], []]})
    out, stats = apply(empty, 8, "wrapped", output_path=tmp_path / "e.arrow")
    assert len(out) == 0 and stats.rows == 0
    assert out.column_names == ["input_ids", "position_ids", "seq_lengths"]


@pytest.mark.parametrize("shard_rows", [0, -1, True])
def test_bad_shard_rows(shard_rows) -> None:
    with pytest.raises(ValueError, match="shard_rows"):
        apply(_dataset([3, 4]), 8, "bfd", shard_rows=shard_rows)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_block_and_chunk_boundaries(strategy: str, monkeypatch) -> None:
    """Tiny position blocks and copy chunks: pieces straddle many block edges."""
    monkeypatch.setattr(_arrow, "_BLOCK", 5)
    monkeypatch.setattr(_arrow, "_CHUNK_BYTES", 8)
    lens = _lengths(9)
    ds = _dataset(lens)
    packed, _ = apply(ds, 16, strategy, columns=COLS)
    assert packed.to_dict() == _expected(ds.to_dict(), lens, 16, strategy)


def test_wrapped_reuses_the_source_buffer() -> None:
    """'wrapped' rows are slices of the input values: no copy of the token ids."""
    ds = _dataset(_lengths(10))
    packed, _ = apply(ds, 16, "wrapped", columns=("input_ids",))
    src = ds.data.column("input_ids").chunk(0).values.buffers()[1]
    out = packed.data.column("input_ids").chunk(0).values.buffers()[1]
    assert out.address == src.address


@pytest.mark.parametrize("list_views", [True, False])
def test_fallback_types_with_and_without_list_views(list_views: bool, monkeypatch) -> None:
    """bool values and values with nulls take Arrow's path (list views, or a per-token take on
    pyarrow without them) and come out exact."""
    lens = _lengths(11)
    rows = {
        "input_ids": [[i * 100 + t for t in range(n)] for i, n in enumerate(lens)],
        "keep": [[(i + t) % 3 == 0 for t in range(n)] for i, n in enumerate(lens)],
        "score": [[None if t % 4 == 1 else i + t for t in range(n)] for i, n in enumerate(lens)],
    }
    ds = datasets.Dataset.from_dict(rows)
    if not list_views:
        monkeypatch.delattr(pa, "ListViewArray")
    for strategy in STRATEGIES:
        packed, _ = apply(ds, 16, strategy, columns=tuple(rows))
        assert packed.to_dict() == _expected(rows, lens, 16, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_position_ids_can_be_left_out(strategy: str, tmp_path) -> None:
    """position_ids=False drops just that column; the rest is unchanged, and the positions
    follow from seq_lengths alone."""
    ds = _dataset(_lengths(12))
    full, _ = apply(ds, 16, strategy, columns=COLS)
    lean, _ = apply(ds, 16, strategy, columns=COLS, position_ids=False)
    lean_disk, _ = apply(ds, 16, strategy, columns=COLS, position_ids=False, shard_rows=5,
                         output_path=tmp_path / "lean.arrow")
    assert lean.column_names == [*COLS, "seq_lengths"] == lean_disk.column_names
    expected = full.remove_columns("position_ids").to_dict()
    assert lean.to_dict() == expected == lean_disk.to_dict()
    assert lean._fingerprint != full._fingerprint
    derived = [[i for n in row for i in range(n)] for row in lean["seq_lengths"]]
    assert derived == full["position_ids"]
