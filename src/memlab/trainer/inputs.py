"""What a run reads besides its configuration, fingerprinted so that a resumed run can tell
whether it is still the same: the data files, the model directory, the tokenizer, the chat
template (:class:`Inputs`, one per name; the data and model options say which files they read).

A checkpoint records each input's fingerprint (:func:`record`): its files with their size and
modification time, and a SHA-256 of their contents; for a hub dataset or model, the repository
and the commit its revision resolved to in the local Hugging Face cache. Resuming compares them
(:func:`changed`) by content alone: a file copied (or touched) without a change still resumes,
and one changed in place is a difference under the key ``inputs.<name>``, refused like a
changed setting unless ``train.resume_allow`` names it, even when its size and modification
time are the old ones (``rsync -a``, ``cp -p`` and ``tar x`` restore the time of a file they
rewrite). Model directories are hashed whole, weights included: a same-shape weight saved over
the old one leaves every safetensors header as it was (hashing headers alone would miss it), and
a resume reads the weights anyway; hashing 1 GB of weights costs 1.0-1.4x that read
(``benchmarks/data_hashing.py``), once per process.

:func:`file_sha256` is also what keys a local file's ``datasets`` cache
(:func:`content_key`; ``datasets`` itself keys it by path and modification time) and what
summary.json records for every data file (:func:`summary_files`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

NAMES = ("data", "model", "tokenizer", "chat_template")
"""The inputs a checkpoint fingerprints (``train.resume_allow=[inputs.data]`` accepts a change)."""

_HASHES: dict[tuple[int, int, int, int, int], str] = {}
"""SHA-256 of files already hashed in this process, by (device, inode, size, mtime_ns, ctime_ns):
a write or a ``utime`` sets the change time to now and nothing sets it back, so a file rewritten
with its modification time restored is hashed again (on a kernel whose change times are coarse,
a few milliseconds, only a rewrite within the same tick as the hash would not be). Not the
path: a relative and an absolute name of one file are hashed once."""

_CHUNK = 1 << 20
"""Bytes read at a time while hashing (memory stays this small for any file size)."""


@dataclass(frozen=True)
class Inputs:
    """The files one input is read from, and/or the hub repository it comes from."""

    files: tuple[Path, ...] = ()
    repo: str | None = None
    """``datasets/<id>`` or ``models/<id>``: a repository of the Hugging Face hub."""
    revision: str | None = None
    """The revision asked for (None: the repository's default branch)."""
    hub_cache: Path | None = field(default=None, compare=False)
    """The Hugging Face hub cache to resolve the revision in (None: huggingface_hub's)."""

    @staticmethod
    def of_paths(paths: Sequence[str | Path], keep: Callable[[Path], bool] | None = None
                 ) -> Inputs:
        """The regular files of ``paths`` (a directory: every file under it, hidden ones
        left out), sorted; ``keep(file)`` picks some of them."""
        files: list[Path] = []
        for p in map(Path, paths):
            p = p.expanduser().absolute()
            if p.is_dir():
                files += [f for f in p.rglob("*") if f.is_file() and not any(
                    part.startswith(".") for part in f.relative_to(p).parts)]
            elif p.is_file():
                files.append(p)
        if keep is not None:
            files = [f for f in files if keep(f)]
        return Inputs(files=tuple(sorted(set(files))))

    def __bool__(self) -> bool:
        return bool(self.files or self.repo)


def _stat(files: tuple[Path, ...]) -> list[dict[str, Any]]:
    """Each file's path, size and modification time (the fast path's comparison)."""
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def sha256_file(path: Path | str, chunk: int = 1 << 23) -> str:
    """The sha256 of the file at ``path``, read in ``chunk``-byte pieces (bounded memory)."""
    sha = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sha.update(view[:n])
    return sha.hexdigest()


def file_sha256(f: str | Path) -> str:
    """The SHA-256 of ``f``'s contents, read in chunks of :data:`_CHUNK` bytes (once per
    process while the file is not written: :data:`_HASHES`)."""
    st = os.stat(f)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(f, _CHUNK)
    return _HASHES[key]


def content_key(files: Sequence[str | Path]) -> str:
    """One SHA-256 over the contents of ``files`` in their order (not their names): the
    ``datasets`` cache key of rows read from them."""
    total = hashlib.sha256()
    for f in files:
        total.update(f"{file_sha256(f)}\n".encode())
    return total.hexdigest()


def _hashed(files: tuple[Path, ...]) -> dict[str, Any]:
    """The fingerprint of ``files``: each one's stat and SHA-256, and one SHA-256 over their
    names (not their directories: a copy elsewhere is the same) and contents."""
    entries = _stat(files)
    total = hashlib.sha256()
    for entry, f in zip(entries, files, strict=True):
        entry["sha256"] = file_sha256(f)
        total.update(f"{f.name}\0{entry['sha256']}\n".encode())
    return {"files": entries, "sha256": total.hexdigest()}


def resolved_revision(inputs: Inputs) -> str | None:
    """The commit ``inputs.revision`` (or the default branch) resolved to when the repository
    was last downloaded (the hub cache's ``refs/``; a commit hash as given), or None when the
    cache does not say."""
    if inputs.repo is None:
        return None
    rev = inputs.revision or "main"
    if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev):
        return rev
    cache = inputs.hub_cache
    if cache is None:
        try:
            from huggingface_hub import constants

            cache = Path(constants.HF_HUB_CACHE)
        except ImportError:  # pragma: no cover - a dependency of transformers
            return None
    kind, _, name = inputs.repo.partition("/")
    ref = cache / f"{kind}--{name.replace('/', '--')}" / "refs" / rev
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def record(inputs: dict[str, Inputs]) -> dict[str, Any]:
    """The fingerprint of every input (what a checkpoint stores as ``inputs``)."""
    out: dict[str, Any] = {}
    for name, inp in inputs.items():
        if not inp:
            continue
        entry: dict[str, Any] = {}
        if inp.files:
            entry.update(_hashed(inp.files))
        if inp.repo is not None:
            entry.update(repo=inp.repo, revision=resolved_revision(inp))
        out[name] = entry
    return out


def describe(old: dict[str, Any] | None, now: dict[str, Any] | None) -> tuple[str, str]:
    """``(checkpoint, this run)``: what differs between two fingerprints of an input, in a few
    words: the files changed, added or gone (by name), or the hub revisions."""
    old, now = old or {}, now or {}
    if old.get("repo") or now.get("repo"):
        return (f"{old.get('repo')}@{old.get('revision')}", f"{now.get('repo')}@{now.get('revision')}")
    before = {Path(e["path"]).name: e for e in old.get("files") or []}
    after = {Path(e["path"]).name: e for e in now.get("files") or []}
    names = sorted(set(before) | set(after))
    differ = [n for n in names if (before.get(n) or {}).get("sha256") != (after.get(n) or {})
              .get("sha256")]

    def side(files: dict[str, Any]) -> str:
        shown = [f"{files[n]['path']} ({files[n]['size']} bytes, sha256 "
                 f"{str(files[n].get('sha256'))[:12]})" if n in files else f"{n}: no such file"
                 for n in differ[:3]]
        return "; ".join(shown) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")

    return side(before), side(after)


def changed(old: dict[str, Any] | None, inp: Inputs) -> tuple[bool, dict[str, Any] | None]:
    """``(whether the input differs from its recorded fingerprint old, its current
    fingerprint)``: the content hashes decide (never the size and modification time, which a
    copy may keep across a change). An input the checkpoint did not record (an older memlab,
    or one this run reads and that run did not) is not compared, nor is a hub revision that
    either side cannot resolve."""
    if old is None:
        return False, None
    now: dict[str, Any] = {}
    files_differ = False
    if inp.files or old.get("files") is not None:
        now.update(_hashed(inp.files))
        files_differ = now["sha256"] != old.get("sha256")
    revision_differs = False
    if inp.repo is not None or old.get("repo") is not None:
        now.update(repo=inp.repo, revision=resolved_revision(inp))
        was = old.get("revision")
        revision_differs = old.get("repo") != inp.repo or (
            was is not None and now["revision"] is not None and was != now["revision"])
    return files_differ or revision_differs, now


class _Source(Protocol):
    def inputs(self) -> dict[str, Inputs]: ...


class _DataSource(_Source, Protocol):
    @property
    def eval(self) -> float | str | None: ...
    def eval_kind(self) -> Literal["fraction", "path", "split"] | None: ...


class RunSources(Protocol):
    """What :func:`of_run` reads of a run's context (a :class:`memlab.protocols.BuildContext`;
    named by what it reads, since the context's data and model options name :class:`Inputs`)."""

    @property
    def data(self) -> _DataSource: ...
    @property
    def model(self) -> _Source: ...


def of_data(data: _DataSource) -> dict[str, Inputs]:
    """The inputs of a data option: its sources' (``data``, or ``data.<label>`` per mixture
    source) and a held-out file (``data.eval=<file>``: ``data.eval``; the best evaluation and
    early stopping compare evaluations made before and after a resume)."""
    held = ({"data.eval": Inputs.of_paths([str(data.eval)])}
            if data.eval_kind() == "path" else {})
    return {**data.inputs(), **held}


def of_run(ctx: RunSources) -> dict[str, Inputs]:
    """Every input of the run ``ctx``: its data's (:func:`of_data`) and its model's."""
    return {**of_data(ctx.data), **ctx.model.inputs()}


def summary_files(inputs: dict[str, Inputs]) -> list[dict[str, Any]]:
    """summary.json's ``data.files``: every file of ``inputs`` with the input it belongs to,
    its size and the SHA-256 of its contents."""
    return [{"input": name, "path": str(f), "bytes": f.stat().st_size, "sha256": file_sha256(f)}
            for name, inp in inputs.items() for f in inp.files]
