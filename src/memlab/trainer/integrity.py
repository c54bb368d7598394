"""Whether a checkpoint's files are the ones it wrote: content hashes, versions, finite tensors.

At save, :mod:`memlab.trainer.checkpoint` records in ``memlab_state.json``

- ``files``: the sha256 of every file of the checkpoint, by path relative to it
  (:func:`file_hashes`). memlab's own safetensors files are hashed while they are written
  (:func:`memlab.trainer.safetensors_writer.write_safetensors`) and DeepSpeed's shards while
  DeepSpeed writes them (its checkpoint engine's ``save`` goes through a
  :class:`~memlab.trainer.safetensors_writer.HashingFile`, :mod:`memlab.distributed.deepspeed`).
  The Hugging Face directory (``model.safetensors`` or its shards, the adapter, the tokenizer,
  ``config.json``, ``merged/``) and DeepSpeed's ``latest`` / ``zero_to_fp32.py`` are hashed
  right after they are written, read back (from the page cache, just written): transformers and
  PEFT write weights with ``safetensors.torch.save_file`` from inside ``save_pretrained``, with
  no hook for the file, and intercepting that would mean patching the library (memlab patches
  none) or redoing ``save_pretrained``'s conversions of the state dict;
- ``state_sha256``: the sha256 of ``memlab_state.json``'s own content (canonical JSON without
  this key: :func:`state_digest`), so that the file holding the hashes is checked too;
- ``versions``: torch, transformers, peft and memlab (:func:`versions`).

At resume, :func:`hash_problems` names every file whose content differs (a flipped byte) or that
is gone: the checkpoint is damaged, and no ``train.resume_allow`` resumes it. A checkpoint from
a memlab that recorded no hashes resumes, with a warning that it cannot be verified. Tensors
loaded are checked to be finite (:func:`nonfinite`): a NaN or Inf in a weight or the optimizer
state is named with its file and tensor instead of surfacing steps later as a diverged loss.
The hashes detect damage (a disk, a copy, an edit), not forgery: whoever can edit the files can
edit the hashes. DeepSpeed's shards, which DeepSpeed unpickles, are also opened first without
running code (:func:`check_pickles`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from memlab.trainer.inputs import sha256_file
from memlab.trainer.state_files import CheckpointError

VERSIONED = ("torch", "transformers", "peft", "memlab")
"""The packages whose versions a checkpoint records (a difference is shown on resume)."""

WHOLE = "copy the whole step directory again, or resume from another checkpoint"

_VERIFIED: dict[Path, tuple] = {}
"""Checkpoints whose hashes this process verified, with each file's (size, mtime, inode) then:
:func:`memlab.trainer.resume.plan_resume` verifies before anything loads, and
:func:`memlab.trainer.checkpoint.load` does not read a multi-GB checkpoint a second time
for it, seconds later, unless one of its files was replaced or changed size or time since."""


def versions() -> dict[str, str]:
    """The installed versions of :data:`VERSIONED` (those installed)."""
    from memlab.measure.summary import versions as installed

    found = installed()
    return {k: found[k] for k in VERSIONED if k in found}


def version_changes(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``versions.<package>``: each recorded version that differs from this run's (a
    checkpoint without versions: none)."""
    was = state.get("versions") or {}
    now = versions()
    return {f"versions.{k}": {"checkpoint": was.get(k), "run": now.get(k)}
            for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k) and k in was}


def state_digest(state: dict[str, Any]) -> str:
    """The sha256 of ``state`` as canonical JSON (sorted keys, no spaces), without its
    ``state_sha256``; the same for the dict that was written and the one read back."""
    import hashlib

    plain = {k: v for k, v in json.loads(json.dumps(state)).items() if k != "state_sha256"}
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _files(root: Path) -> Iterator[Path]:
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            yield p


def file_hashes(root: Path, written: Mapping[str, str], skip: str) -> dict[str, str]:
    """The sha256 of every file under ``root`` but ``skip`` (the state file), by path relative
    to ``root``: those in ``written`` as hashed when they were written, the others read now
    (module docstring: the files other libraries write)."""
    out = {}
    for p in _files(root):
        rel = p.relative_to(root).as_posix()
        if rel != skip:
            out[rel] = written.get(rel) or sha256_file(p)
    return out


def _signature(path: Path, files: Mapping[str, str]) -> tuple | None:
    out = []
    for rel in sorted(files):
        try:
            st = (path / rel).stat()
        except OSError:
            return None
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def hash_problems(path: Path, state: dict[str, Any], state_file: str,
                  named: Collection[Path] = ()) -> list[str]:
    """Every file of checkpoint ``path`` whose content differs from the sha256 recorded when it
    was written, or that is missing, each named; ``memlab_state.json`` (``state_file``) itself
    checked against its ``state_sha256``. Files in ``named`` or under a directory in it (a
    problem already said) are skipped. Empty for a checkpoint that recorded no hashes (:func:`verifiable`)."""
    files = state.get("files")
    if not isinstance(files, dict):
        return []
    problems = []
    if state.get("state_sha256") != state_digest(state):
        problems.append(f"{path / state_file} does not match the sha256 recorded in it (its "
                        "content changed after it was written); the checkpoint is damaged: "
                        f"{WHOLE}")
    key = path.resolve()
    signature = _signature(path, files)
    if signature is not None and _VERIFIED.get(key) == signature:
        return problems
    for rel, want in sorted(files.items()):
        file = path / rel
        if file in named or any(d in named for d in file.parents):
            continue
        if not file.is_file():
            problems.append(f"{file} is missing: the checkpoint was written with it (its "
                            f"sha256 is in {state_file}); the checkpoint is incomplete: {WHOLE}")
        elif sha256_file(file) != want:
            problems.append(f"{file} does not match the sha256 recorded when the checkpoint was "
                            f"written ({state_file}): its content changed; the checkpoint is "
                            f"damaged: {WHOLE}")
    if not problems and signature is not None:
        _VERIFIED[key] = signature
    return problems


def verifiable(state: dict[str, Any]) -> bool:
    """Whether the checkpoint recorded its files' hashes (memlab since issue 43)."""
    return isinstance(state.get("files"), dict)


_CHUNK = 1 << 22
"""Elements checked at a time (no copy of a whole large tensor)."""


def nonfinite(tensors: Mapping[str, torch.Tensor], file: Path | str) -> str | None:
    """What is wrong with the first floating-point tensor of ``tensors`` (read from ``file``)
    that holds a NaN or an Inf, or None when every one is finite."""
    for name, t in tensors.items():
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            continue
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            part = flat[start:start + _CHUNK]
            low, high = torch.aminmax(part)  # NaN propagates; an Inf is the min or the max
            if torch.isfinite(low) and torch.isfinite(high):
                continue
            bad = (~torch.isfinite(part)).nonzero()
            first = start + int(bad[0]) if len(bad) else start
            value = float(flat[first])
            return (f"{file}: tensor {name!r} holds a non-finite value ({value} at flat index "
                    f"{first} of {flat.numel()}); memlab does not resume a NaN or Inf weight or "
                    "optimizer state: the checkpoint is damaged, or was saved after the run "
                    "diverged; resume from an earlier checkpoint")
    return None


def nonfinite_in(tree: Any, file: Path, where: str = "") -> str | None:
    """:func:`nonfinite` for every tensor in a nested state (dicts, lists, tuples; DeepSpeed's
    shards), named by its path in it."""
    if isinstance(tree, torch.Tensor):
        return nonfinite({where or "tensor": tree}, file)
    items: Any = (tree.items() if isinstance(tree, dict)
                  else enumerate(tree) if isinstance(tree, (list, tuple)) else ())
    for k, v in items:
        problem = nonfinite_in(v, file, f"{where}/{k}" if where else str(k))
        if problem:
            return problem
    return None


DEEPSPEED_SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                          "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                          "deepspeed.runtime.zero.config.ZeroStageEnum",
                          "deepspeed.utils.tensor_fragment.fragment_address")
"""Plain-data classes DeepSpeed pickles into its checkpoints (allowed when its files are
checked with ``weights_only=True``)."""


def check_pickles(directory: Path) -> None:
    """Open every ``*.pt`` file under ``directory`` with ``torch.load(weights_only=True)``
    (memory-mapped: unpickling reads no tensor data): a file that would run code, or holds anything but
    tensors, plain data and :data:`DEEPSPEED_SAFE_GLOBALS`, raises CheckpointError; so does one
    that holds a NaN or Inf (:func:`nonfinite_in`: DeepSpeed's shards of the weights and the
    optimizer state; this reads their data)."""
    allowed = []
    for qual in DEEPSPEED_SAFE_GLOBALS:
        module, _, name = qual.rpartition(".")
        try:
            allowed.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    for f in sorted(directory.rglob("*.pt")):
        try:
            with torch.serialization.safe_globals(allowed):
                loaded = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - refused, whatever the unpickler said
            first = str(e).strip().splitlines()
            raise CheckpointError(
                f"refused {f}: it is not plain tensors and data ({type(e).__name__}: "
                f"{first[-1] if first else ''}); memlab loads no checkpoint file that could run "
                "code. Use checkpoints you wrote yourself") from e
        problem = nonfinite_in(loaded, f)
        del loaded
        if problem:
            raise CheckpointError(problem)
