"""Damaged checkpoint state is never taken for good (issue 43, item 1): a checkpoint records the
sha256 of every file it writes (memlab's own safetensors hashed while written, by a streaming
writer byte-identical to safetensors') and the versions it was written with; resume refuses a
file whose content changed (a flipped byte in a weight, a NaN written into the optimizer state)
as ``invalid``, naming the file, whatever ``train.resume_allow`` says; a NaN in a checkpoint
without hashes is named with its file and tensor; an old checkpoint without hashes resumes
unverified with a warning; a version difference is recorded, not refused; and
``resume_from=latest`` passes over a damaged newer checkpoint, naming it."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from memlab.trainer import integrity
from memlab.trainer.checkpoint import OPTIMIZER, STATE, STATE_TENSORS
from memlab.trainer.safetensors_writer import _DTYPES, write_safetensors
from memlab_testing import run_job
from reliability.helpers import SMOKE

pytestmark = pytest.mark.integration

ALLOW_ALL = "train.resume_allow=[train,model,data,method,optimizer,precision,peft]"
"""Everything a config can change: still no damaged file resumes."""


# --------------------------------------------------------------------------- the writer
def test_the_streaming_writer_is_byte_identical_to_safetensors_and_hashes_what_it_wrote(
        tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {f"t_{dt}".replace("torch.", ""): (torch.randn(3, 5, generator=g) * 4).to(dt)
               if dt.is_floating_point else torch.randint(0, 100, (3, 5), generator=g).to(dt)
               for dt in _DTYPES}
    tensors |= {"strided/é": torch.arange(12.0).reshape(3, 4)[:, 1::2],  # not contiguous
                "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
                'ctl\x01"q': torch.ones(1)}
    for case in ({}, tensors):
        for metadata in ({"format": "pt"}, None):
            ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
            digest = write_safetensors(ours, case, metadata)
            save_file({k: v.contiguous() for k, v in case.items()}, theirs, metadata=metadata)
            assert ours.read_bytes() == theirs.read_bytes()
            assert digest == hashlib.sha256(ours.read_bytes()).hexdigest()
    back = load_file(tmp_path / "ours.safetensors")
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8),
                           v.contiguous().reshape(-1).view(torch.uint8)), k


# ---------------------------------------------------------------------- a real checkpoint
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny run's checkpoints at steps 1 and 2 (the files the run read back to hash them,
    recorded)."""
    root = tmp_path_factory.mktemp("ckpt")
    read_back: list[str] = []
    real = integrity.sha256_file

    def recording(path, *a, **kw):
        read_back.append(Path(path).name)
        return real(path, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(integrity, "sha256_file", recording)
        s = run_job(root, [*SMOKE, "train.steps=2", "train.save_every=1",
                           "measure.memory_steps=0"], fast=False)
    assert s["status"] == "ok", s["error"]
    return Path(s["train"]["checkpoint"]).parent, read_back


def _copy(saved, tmp_path: Path, step: int = 2) -> Path:
    copy = tmp_path / "run" / "checkpoints" / f"step_{step:06d}"
    shutil.copytree(saved[0] / copy.name, copy)
    return copy


def _resume(tmp_path: Path, *overrides: str) -> dict:
    return run_job(tmp_path, [*SMOKE, "train.steps=3", "measure.memory_steps=0",
                              "train.resume_allow=[train.steps]", *overrides],
                   fast=False, name="resumed")


def _edit_state(ckpt: Path, edit) -> None:
    state = json.loads((ckpt / STATE).read_text())
    edit(state)
    (ckpt / STATE).write_text(json.dumps(state))


def _offset_of(file: Path, name: str) -> int:
    """Where tensor ``name``'s bytes start in safetensors ``file``."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]


def test_a_checkpoint_records_every_file_its_sha256_and_versions(saved):
    ckpt = saved[0] / "step_000002"
    state = json.loads((ckpt / STATE).read_text())
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert set(state["files"]) == on_disk - {STATE}
    assert {"model.safetensors", OPTIMIZER, STATE_TENSORS, "tokenizer.json"} <= on_disk
    for rel, digest in state["files"].items():
        assert hashlib.sha256((ckpt / rel).read_bytes()).hexdigest() == digest, rel
    assert state["state_sha256"] == integrity.state_digest(state)
    assert set(state["versions"]) == {"torch", "transformers", "peft", "memlab"}
    assert state["versions"]["torch"] == torch.__version__
    # memlab's own files were hashed as they were written; only other libraries' read back
    assert OPTIMIZER not in saved[1] and STATE_TENSORS not in saved[1]
    assert "model.safetensors" in saved[1]  # written by transformers' save_pretrained


def test_a_flipped_byte_in_a_weight_is_invalid_naming_the_file_whatever_is_allowed(
        saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    model = ckpt / "model.safetensors"
    at = _offset_of(model, "model.layers.0.self_attn.q_proj.weight") + 2
    raw = bytearray(model.read_bytes())
    raw[at] ^= 0x40  # one exponent bit of one weight: x65536, still a finite number
    model.write_bytes(bytes(raw))
    s = _resume(tmp_path, f"train.resume_from={ckpt}", ALLOW_ALL)
    assert s["status"] == "invalid", s["error"]
    assert (f"{model} does not match the sha256 recorded when the checkpoint was written"
            in s["error"]) and "the checkpoint is damaged" in s["error"]
    assert s["memory"] is None  # refused before anything loads


def test_a_nan_in_the_optimizer_state_is_invalid_naming_the_file_and_with_no_hashes_the_tensor(
        saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    opt = ckpt / OPTIMIZER
    header = json.loads(opt.read_bytes()[8:8 + struct.unpack("<Q", opt.read_bytes()[:8])[0]])
    name = next(k for k, v in header.items() if k.endswith("exp_avg_sq")
                and v.get("dtype") == "F32")
    raw = bytearray(opt.read_bytes())
    at = _offset_of(opt, name)
    raw[at:at + 4] = struct.pack("<f", float("nan"))
    opt.write_bytes(bytes(raw))
    s = _resume(tmp_path, f"train.resume_from={ckpt}")
    assert s["status"] == "invalid", s["error"]
    assert f"{opt} does not match the sha256 recorded" in s["error"]
    # a checkpoint without hashes (an older memlab's): the NaN itself is found, not a loss later
    _edit_state(ckpt, lambda st: [st.pop(k) for k in ("files", "state_sha256")])
    s = _resume(tmp_path / "old", f"train.resume_from={ckpt}")
    assert s["status"] == "invalid", s["error"]
    assert f"{opt}: tensor {name!r} holds a non-finite value (nan at flat index 0" in s["error"]
    assert "lower train.lr" not in s["error"]


def test_an_old_checkpoint_resumes_unverified_with_a_warning_and_versions_are_recorded(
        saved, tmp_path, capfd):
    ckpt = _copy(saved, tmp_path)

    def older(state: dict) -> None:  # as memlab wrote it before hashes, with another torch
        del state["files"], state["state_sha256"]
        state["versions"]["torch"] = "2.0.0"
    _edit_state(ckpt, older)
    s = _resume(tmp_path, f"train.resume_from={ckpt}")
    assert s["status"] == "ok", s["error"]
    assert s["resume"]["verified"] is False
    assert s["resume"]["changed"]["versions.torch"] == {"checkpoint": "2.0.0",
                                                        "run": torch.__version__}
    assert "train.steps" in s["resume"]["changed"] and "versions.memlab" not in s["resume"][
        "changed"]
    err = capfd.readouterr().err
    assert f"{ckpt} records no sha256 of its files" in err and "cannot be verified" in err


def test_latest_passes_over_a_damaged_newer_checkpoint_and_names_it(saved, tmp_path):
    older, newer = _copy(saved, tmp_path, 1), _copy(saved, tmp_path, 2)
    state_file = newer / STATE_TENSORS
    raw = bytearray(state_file.read_bytes())
    raw[-1] ^= 0x01
    state_file.write_bytes(bytes(raw))
    s = _resume(tmp_path / "again", "train.resume_from=latest",
                f"train.resume_root={tmp_path / 'run'}")
    assert s["status"] == "ok", s["error"]
    assert s["resume"]["from"] == str(older) and s["resume"]["verified"] is True
    (skipped,) = s["resume"]["skipped"]
    assert skipped["checkpoint"] == str(newer)
    assert f"{state_file} does not match the sha256 recorded" in skipped["why"]


def test_the_hashing_benchmark_composes_and_validates(capsys):
    """benchmarks/checkpoint_hashing.py's real-size run is a valid configuration (nothing built)."""
    import importlib.util

    from memlab_testing import REPO

    spec = importlib.util.spec_from_file_location(
        "checkpoint_hashing", REPO / "benchmarks" / "checkpoint_hashing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--dry-run"]) == 0
    assert "valid: tiny hidden_size=896" in capsys.readouterr().out
