"""A record at a fallback path is this job's only when it carries the job's record id, and the
temp dir's fallback place is private to the user (issue 43, forged records): a file planted or
left there is never merged into another job's record."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from memlab.measure.summary import (
    FALLBACK_ENV,
    fallback_name,
    fallback_paths,
    read_summary,
    write_summary,
)


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """The temp dir (where ``memlab-unsaved/`` lives) is this test's; no $MEMLAB_FALLBACK_DIR."""
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


def test_a_fallback_record_is_read_only_with_its_record_id(tmp_path, temp_dir):
    wanted = tmp_path / "ro" / "summary.json"
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    if os.access(tmp_path / "ro", os.W_OK):  # (root writes anywhere: make it a file's child)
        wanted = tmp_path / "a_file" / "summary.json"
        (tmp_path / "a_file").write_text("")
    where, why = write_summary(wanted, {"status": "ok", "job": {"record_id": "mine"}})
    assert where.parent == temp_dir / "memlab-unsaved" and why
    assert (temp_dir / "memlab-unsaved").stat().st_mode & 0o777 == 0o700
    assert read_summary(wanted, "mine")["status"] == "ok"
    assert read_summary(wanted, "another run's") is None  # stale: never this job's
    assert read_summary(wanted) is None  # no id: the path itself only


def test_a_planted_record_is_never_taken(tmp_path, temp_dir):
    wanted = tmp_path / "job" / "summary.json"
    place = temp_dir / "memlab-unsaved"
    place.mkdir(mode=0o700)
    forged = {"status": "ok", "throughput": {"tokens_per_s": 999999},
              "job": {"record_id": "guessed"}}
    (place / fallback_name(wanted)).write_text(json.dumps(forged))
    assert read_summary(wanted, "the job's own id") is None


def test_a_fallback_place_that_is_not_private_is_skipped(tmp_path, temp_dir):
    place = temp_dir / "memlab-unsaved"
    place.mkdir()
    place.chmod(0o777)  # ours but open: made private again before use
    assert fallback_paths(tmp_path / "x.json")[0].parent == place
    assert place.stat().st_mode & 0o777 == 0o700
    os.rmdir(place)
    (tmp_path / "elsewhere").mkdir()
    place.symlink_to(tmp_path / "elsewhere")  # a link planted at its name: not used
    assert all(p.parent != place for p in fallback_paths(tmp_path / "x.json", create=True))
    if os.getuid() == 0:  # (only root can give a directory away)
        place.unlink()
        place.mkdir(mode=0o700)
        os.chown(place, 4242, 4242)  # another user's
        assert all(p.parent != place for p in fallback_paths(tmp_path / "x.json", create=True))
