"""``data.path`` (data=local) names what it was given when it cannot be read as a file: a link
loop, a dangling link, a pipe (a process substitution), a device; an absolute glob and ``~``
work like a relative one."""

from __future__ import annotations

import os

from memlab.data.local import Local


def _errors(path) -> str:
    return " | ".join(Local(path=str(path)).file_errors())


def test_what_is_not_a_file_is_named_for_what_it_is(tmp_path):
    (tmp_path / "a.jsonl").symlink_to(tmp_path / "b.jsonl")
    (tmp_path / "b.jsonl").symlink_to(tmp_path / "a.jsonl")
    assert "is a symbolic link loop" in _errors(tmp_path / "a.jsonl")
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "missing.jsonl")
    assert "is a symbolic link to" in _errors(tmp_path / "gone.jsonl")
    os.mkfifo(tmp_path / "rows.jsonl")
    assert "is a pipe (a process substitution" in _errors(tmp_path / "rows.jsonl")
    assert "/dev/zero is a device, not a regular file" in _errors("/dev/zero")
    assert "no such file" in _errors(tmp_path / "nope.jsonl")


def test_absolute_and_home_globs_find_their_files(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    for name in ("x.jsonl", "y.jsonl"):
        (tmp_path / "d" / name).write_text('{"text": "hi"}\n')
    assert Local(path=str(tmp_path / "d" / "*.jsonl"))._files() == [
        str(tmp_path / "d" / "x.jsonl"), str(tmp_path / "d" / "y.jsonl")]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _errors("~/d/*.jsonl") == ""
    assert len(Local(path="~/d/*.jsonl")._files()) == 2
