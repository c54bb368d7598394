"""`data=local`: your own jsonl / json / parquet / csv file(s) through ``datasets``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from memlab.data.base import limit
from memlab.registry import register

_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@register("data", "local")
@dataclass(kw_only=True)
class Local:
    """Files to read; rows use the same fields as hub data (messages / text / prompt+completion
    for SFT; prompt, chosen, rejected for preference methods)."""

    path: str = "???"
    """A file, a glob, or a directory of files of one format."""
    format: Literal["auto", "json", "parquet", "csv"] = "auto"
    max_examples: int | None = None
    shuffle_seed: int | None = None

    def _files(self) -> list[str]:
        p = Path(self.path).expanduser()
        if p.is_dir():
            return sorted(str(f) for f in p.iterdir() if f.suffix in _BY_SUFFIX)
        if any(c in self.path for c in "*?["):
            return sorted(str(f) for f in Path().glob(self.path))
        return [str(p)] if p.exists() else []

    def _format(self, files: list[str]) -> str:
        if self.format != "auto":
            return self.format
        return _BY_SUFFIX.get(Path(files[0]).suffix, "json")

    def validate(self, ctx) -> list[str]:
        if self.path in ("???", ""):
            return ["data=local needs data.path=<file, glob or dir> (jsonl/json/parquet/csv)"]
        files = self._files()
        if not files:
            return [f"data.path={self.path!r}: no such file (or no jsonl/json/parquet/csv in it)"]
        if self.format == "auto" and Path(files[0]).suffix not in _BY_SUFFIX:
            return [f"data.path={self.path!r}: unknown format; set data.format=json|parquet|csv"]
        return []

    def load(self, ctx):
        import datasets

        files = self._files()
        ds = datasets.load_dataset(self._format(files), data_files=files, split="train")
        return limit(ds, self.max_examples, self.shuffle_seed)
