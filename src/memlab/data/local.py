"""`data=local`: your own jsonl / json / parquet / csv file(s) through ``datasets``.

A file ``datasets`` cannot read is read again here to say where and why: the file and line of
malformed JSON, a row that is not an object, a field whose type changes between rows. An empty
file is reported before anything loads; a row that a method rejects is named by file and line
(:meth:`Local.locate`).

The rows ``datasets`` prepares are cached under a name that carries the SHA-256 of the files'
contents (:func:`memlab.trainer.inputs.content_key`): ``datasets`` alone keys a local file by
its path and modification time, and a file rewritten with its time restored (``rsync -a``,
``cp -p``, ``tar x``) would be read from the old rows. An unchanged file is hashed (a streaming
read, ~0.3 s for 200 MB: ``benchmarks/data_hashing.py``) and its cached rows are reused.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from memlab.data.base import DataError, limit, register
from memlab.data.formats import RowOptions
from memlab.registry import PositiveInt, Seed
from memlab.trainer.inputs import Inputs, content_key

if TYPE_CHECKING:
    from memlab.context import BuildContext

_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@register("local")
@dataclass(kw_only=True)
class Local(RowOptions):
    """Files to read; rows in any of TRL's dataset types (text / messages, prompt, prompt +
    completion, prompt + chosen + rejected, prompt + completion + label), ShareGPT or Alpaca
    (:mod:`memlab.data.formats`), as for hub data."""

    path: str = "???"
    """A file, a glob, or a directory of files of one format."""
    format: Literal["auto", "json", "parquet", "csv"] = "auto"
    max_examples: PositiveInt | None = None
    """Keep only this many rows (a seeded sample when shuffle_seed is set)."""
    shuffle_seed: Seed | None = None
    """Seed of the sample that max_examples keeps (None: the first rows)."""

    def _files(self) -> list[str]:
        p = Path(self.path).expanduser()
        if p.is_dir():
            return sorted(str(f) for f in p.iterdir() if f.suffix in _BY_SUFFIX)
        if any(c in self.path for c in "*?["):  # relative or absolute, ~ expanded
            return sorted(f for f in glob.glob(str(p)) if not os.path.isdir(f))
        return [str(p)] if p.exists() or p.is_symlink() else []

    def _format(self, files: list[str]) -> str:
        if self.format != "auto":
            return self.format
        return _BY_SUFFIX.get(Path(files[0]).suffix, "json")

    def validate(self, ctx: BuildContext) -> list[str]:
        return self.file_errors()

    def file_errors(self) -> list[str]:
        """Problems found before anything is read: the shared fields, then the files."""
        errors = self.row_errors()
        if self.path in ("???", ""):
            return [*errors, "data=local needs data.path=<file, glob or dir> "
                    "(jsonl/json/parquet/csv)"]
        files = self._files()
        if not files:
            return [*errors, f"data.path={self.path!r}: no such file (or no "
                    "jsonl/json/parquet/csv in it)"]
        special = [(f, _not_a_file(Path(f))) for f in files]
        if any(why for _, why in special):
            return errors + [f"data.path={self.path!r}: {f} {why}" for f, why in special if why]
        if self.format == "auto" and Path(files[0]).suffix not in _BY_SUFFIX:
            return [*errors, f"data.path={self.path!r}: unknown format; set "
                    "data.format=json|parquet|csv"]
        return errors + [f"data.path={self.path!r}: {f} is empty; give it rows (or remove it)"
                         for f in files if _is_empty(Path(f))]

    def inputs(self) -> dict[str, Inputs]:
        return {"data": Inputs.of_paths(self._files())}

    def load(self, ctx: BuildContext):
        import datasets

        files = self._files()
        fmt = self._format(files)
        if fmt in ("json", "csv"):  # datasets reads bytes that are not UTF-8 and fails later
            for f in files:
                problem = _encoding_problem(Path(f))
                if problem is not None:
                    raise DataError(problem)
        try:  # datasets keys its cache by path and time: name the config by the content
            ds = datasets.load_dataset(fmt, name=f"sha256-{content_key(files)}",
                                       data_files=files, split="train")
        except Exception as e:  # noqa: BLE001 - read again to say where and why
            problem = _diagnose(files) if fmt == "json" else None
            if problem is not None:
                raise DataError(problem) from e
            raise DataError(f"data.path={self.path!r}: datasets cannot read "
                            f"{', '.join(files)} as {fmt}: {type(e).__name__}: {e}") from e
        return limit(ds, self.max_examples, self.shuffle_seed)

    def place(self, index: int) -> str:
        """``"<file> line <n>"`` (jsonl / csv), ``"<file> item <n>"`` (a JSON array) or
        ``"<file> row <n>"`` (parquet) of row ``index`` of the files as read."""
        files = self._files()
        fmt = self._format(files)
        rest = index
        for f in files:
            places = _places(Path(f), fmt)
            if rest < len(places):
                return f"{f} {places[rest]}"
            rest -= len(places)
        return f"{', '.join(files)} row {index}"


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` is not a regular file memlab can read (several times: to check it, to
    tokenize it, to name a bad row), or None."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop (it never reaches a file)"
        if path.is_symlink():
            return f"is a symbolic link to {os.readlink(path)!r}, which does not exist"
        return f"cannot be read: {e.strerror or e}"
    if stat.S_ISFIFO(mode):
        return ("is a pipe (a process substitution such as <(cat rows.jsonl)?): memlab reads "
                "its data more than once (to check it, to tokenize it, to name a bad row); "
                "write it to a file and give that file")
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a regular file; give a file of rows"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a regular file; give a file of rows"
    if not stat.S_ISREG(mode):
        return "is not a regular file; give a file of rows"
    return None


def _is_empty(path: Path) -> bool:
    """No bytes, or (small files) nothing but whitespace."""
    size = path.stat().st_size
    return size == 0 or (size < 65536 and not path.read_bytes().strip())


def _places(path: Path, fmt: str) -> list[str]:
    """Where each row of one file is, in the order ``datasets`` reads them."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return [f"row {i}" for i in range(pq.ParquetFile(path).metadata.num_rows)]
    if fmt == "csv":
        import csv

        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            next(reader, None)  # the header
            out = []
            start = reader.line_num + 1
            for _ in reader:
                out.append(f"line {start}")
                start = reader.line_num + 1
            return out
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return [f"item {i}" for i in range(len(json.loads(text)))]
    return [f"line {n}" for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _encoding_problem(path: Path) -> str | None:
    """The first line of a text data file that is not UTF-8, named with the byte at fault (one
    pass over the lines), or None."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{path} line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                        f"{len(raw[:e.start].decode('utf-8', errors='replace')) + 1}: "
                        f"{e.reason}); save the file as UTF-8")
    return None


def _surrogate(value: object) -> str | None:
    """A string in ``value`` (a parsed JSON row) with a lone surrogate escape (``\\ud800``:
    half of a UTF-16 pair, no character), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(
        value, list) else ()
    for item in items:
        found = _surrogate(item)
        if found is not None:
            return found
    return None


def _diagnose(files: list[str]) -> str | None:
    """The first problem that stops JSON files from being read as rows, with its file and line:
    malformed JSON, a row that is not an object, a field whose type differs from earlier rows
    (None: none found)."""
    for name in files:
        path = Path(name)
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.lstrip().startswith("["):  # one JSON array of rows
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                return f"{path} line {e.lineno} column {e.colno}: malformed JSON ({e.msg})"
            numbered = [(f"item {i}", r) for i, r in enumerate(rows)]
        else:  # JSON lines
            numbered = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    numbered.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    return (f"{path} line {n}: malformed JSON ({e.msg} at column {e.colno}); "
                            "each line of a .jsonl file must be one JSON object")
        types: dict[str, tuple[str, str]] = {}
        for where, row in numbered:
            if not isinstance(row, dict):
                return (f"{path} {where}: a row must be a JSON object with named fields, got "
                        f"{type(row).__name__}")
            for key, value in row.items():
                bad = _surrogate(value)
                if bad is not None:
                    lone = next(f"\\u{ord(c):04x}" for c in bad if 0xD800 <= ord(c) <= 0xDFFF)
                    return (f"{path} {where}: field '{key}' holds a lone surrogate escape "
                            f"({lone}: half of a UTF-16 pair, not a character); fix the "
                            "escape, or remove it")
                kind = _kind(value)
                if kind == "null":
                    continue
                seen = types.setdefault(key, (kind, where))
                if seen[0] != kind:
                    return (f"{path} {where}: field '{key}' is {kind}, but {seen[1]} has "
                            f"{seen[0]}; every row must give a field the same type")
    return None


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"
