"""A data file rewritten in place with its modification time restored (``rsync -a``, ``cp -p``,
``tar x``) is new data (issue 43, item 2): the run trains its new rows, not the rows ``datasets``
cached for its path and time, and a resume from a checkpoint of the old rows reports the
difference; summary.json records the SHA-256 of every file the rows and the held-out rows
come from (in-process runs on tiny files)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from memlab_testing import run_job
from reliability.helpers import SMOKE

pytestmark = pytest.mark.integration

LOCAL = [o for o in SMOKE if not o.startswith("data.")]
OLD = [{"messages": [{"role": "user", "content": f"question {i}"},
                     {"role": "assistant", "content": f"answer number {i} " * 3}]}
       for i in range(8)]
NEW = [{"messages": [{"role": "user", "content": f"question {i}"},  # the same size, other tokens
                     {"role": "assistant", "content": f"zq xv wk jjqq {i} " * 3}]}
       for i in range(8)]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp_path, *overrides: str, name: str = "run") -> dict:
    return run_job(tmp_path, [*LOCAL, *overrides], fast=False, name=name)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_rewritten_with_its_time_restored_trains_its_new_rows(tmp_path, monkeypatch):
    import datasets

    cache = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    data = _write(tmp_path / "rows.jsonl", OLD)
    old_sha, size = _sha(data), data.stat().st_size
    o = ["data=local", f"data.path={data}", "train.steps=2", "train.save_every=1"]
    first = _run(tmp_path, *o)
    assert first["status"] == "ok", first["error"]
    assert first["data"]["files"] == [{"input": "data", "path": str(data), "bytes": size,
                                       "sha256": old_sha}]
    arrows = set(cache.rglob("*.arrow"))
    assert arrows  # the rows were cached
    again = _run(tmp_path, *o, name="again")  # unchanged: the cached rows are reused
    assert again["status"] == "ok", again["error"]
    assert set(cache.rglob("*.arrow")) == arrows
    assert again["data"]["tokens_in"] == first["data"]["tokens_in"]

    st = data.stat()
    _write(data, NEW)  # as rsync -a leaves it: other bytes, the same size and time
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (size, st.st_mtime_ns)
    new_sha = _sha(data)
    rewritten = _run(tmp_path, *o, name="rewritten")
    assert rewritten["status"] == "ok", rewritten["error"]
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    fresh = _run(tmp_path, *o, name="fresh")  # what these bytes give with nothing cached
    assert fresh["status"] == "ok", fresh["error"]
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    assert fresh["data"]["tokens_in"] != first["data"]["tokens_in"]  # the rows differ
    for key in ("tokens_in", "tokens_trained", "trainable_tokens"):
        assert rewritten["data"][key] == fresh["data"][key], key
    assert rewritten["data"]["files"][0]["sha256"] == new_sha

    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    resumed = _run(tmp_path, *o, f"train.resume_from={ckpt}", name="resumed")
    assert resumed["status"] == "invalid", resumed["error"]
    assert f"inputs.data: \"{data} ({size} bytes, sha256 {old_sha[:12]})" in resumed["error"]
    assert f"{data} ({size} bytes, sha256 {new_sha[:12]})" in resumed["error"]
    assert "train.resume_allow='[inputs.data]'" in resumed["error"]


def test_the_summary_records_every_source_and_held_out_file(tmp_path):
    a, b = _write(tmp_path / "a.jsonl", OLD), _write(tmp_path / "b.jsonl", NEW)
    held = _write(tmp_path / "val.jsonl", OLD[:2])
    s = _run(tmp_path, "data=mixture", f"+data.sources.a={{name: local, path: {a}, weight: 1}}",
             f"+data.sources.b={{name: local, path: {b}, weight: 1}}", f"data.eval={held}",
             "train.eval_every=1", "train.steps=1")
    assert s["status"] == "ok", s["error"]
    assert s["data"]["files"] == [
        {"input": name, "path": str(f), "bytes": f.stat().st_size, "sha256": _sha(f)}
        for name, f in (("data.a", a), ("data.b", b), ("data.eval", held))]
