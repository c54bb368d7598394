"""Data files are known by their content, never by their size and modification time (issue 43,
item 2): ``rsync -a``, ``cp -p`` and ``tar x`` rewrite a file and restore its time. The
``datasets`` cache of a local file (``data=local``; ``data=hub`` given a local directory) is
named by the SHA-256 of its contents, and still reused while the file is unchanged; a resume's
fingerprint compares hashes (:mod:`memlab.trainer.inputs`); hashing reads in fixed chunks."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
from pathlib import Path

import pytest

from memlab.data.hub import Hub
from memlab.data.local import Local
from memlab.trainer import inputs


def _rows(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _rewrite_keeping_time(path: Path, write) -> None:
    """Rewrite ``path`` as ``rsync -a`` / ``cp -p`` leave it: new bytes, the old mtime."""
    st = path.stat()
    write()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty ``datasets`` cache of this test's own."""
    import datasets

    where = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(where))
    return where


def _arrow_files(cache: Path) -> set[Path]:
    return set(cache.rglob("*.arrow"))


def test_file_sha256_streams_in_chunks_and_sees_a_rewrite_with_the_time_restored(tmp_path):
    big = tmp_path / "big.bin"
    data = os.urandom(3 * inputs._CHUNK + 12345)  # not a multiple of the chunk
    big.write_bytes(data)
    assert inputs.file_sha256(big) == hashlib.sha256(data).hexdigest()
    tracemalloc.start()
    try:
        inputs._HASHES.clear()
        inputs.file_sha256(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * inputs._CHUNK, peak  # one buffer, never the file
    other = bytearray(data)
    other[len(data) // 2] ^= 0xFF  # same size, one byte
    _rewrite_keeping_time(big, lambda: big.write_bytes(bytes(other)))
    assert inputs.file_sha256(big) == hashlib.sha256(other).hexdigest()  # not the cached one


def test_resume_fingerprint_reports_a_rewrite_with_size_and_time_kept(tmp_path):
    f = _rows(tmp_path / "rows.jsonl", ["alpha", "beta"])
    recorded = inputs.record({"data": inputs.Inputs.of_paths([f])})["data"]
    assert inputs.changed(recorded, inputs.Inputs.of_paths([f]))[0] is False
    _rewrite_keeping_time(f, lambda: _rows(f, ["gamma", "iota"]))  # same size
    assert f.stat().st_size == recorded["files"][0]["size"]
    differs, now = inputs.changed(recorded, inputs.Inputs.of_paths([f]))
    assert differs and now["files"][0]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    was, is_now = inputs.describe(recorded, now)
    assert recorded["files"][0]["sha256"][:12] in was and now["sha256"] != recorded["sha256"]
    assert now["files"][0]["sha256"][:12] in is_now


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_local_file_rewritten_with_its_time_restored_is_read_again(tmp_path, cache, fmt):
    import pandas as pd

    f = tmp_path / f"rows.{fmt}"

    def write(texts: list[str]) -> None:
        frame = pd.DataFrame({"text": texts})
        if fmt == "jsonl":
            _rows(f, texts)
        elif fmt == "csv":
            frame.to_csv(f, index=False)
        else:
            frame.to_parquet(f, index=False)

    write(["old one", "old two"])
    first = Local(path=str(f)).load(None)
    assert first["text"] == ["old one", "old two"]
    cached = _arrow_files(cache)
    again = Local(path=str(f)).load(None)
    assert _arrow_files(cache) == cached  # unchanged: the cache is reused, nothing written
    assert again._fingerprint == first._fingerprint
    assert [c["filename"] for c in again.cache_files] == [c["filename"] for c in
                                                         first.cache_files]
    _rewrite_keeping_time(f, lambda: write(["new one", "new two"]))
    after = Local(path=str(f)).load(None)
    assert after["text"] == ["new one", "new two"]
    assert after._fingerprint != first._fingerprint
    assert len(_arrow_files(cache)) == len(cached) + 1


def test_a_hub_dataset_given_as_a_local_dir_is_read_again(tmp_path, cache):
    d = tmp_path / "set"
    d.mkdir()
    f = _rows(d / "train.jsonl", ["old one", "old two"])
    assert Hub(path=str(d)).load(None)["text"] == ["old one", "old two"]
    cached = _arrow_files(cache)
    assert Hub(path=str(d)).load(None)["text"] == ["old one", "old two"]
    assert _arrow_files(cache) == cached  # reused
    _rewrite_keeping_time(f, lambda: _rows(f, ["new one", "new two"]))
    assert Hub(path=str(d)).load(None)["text"] == ["new one", "new two"]
