"""`data=hub`: any Hugging Face hub dataset (``datasets.load_dataset(path, name, split)``).
Works offline from a warm HF cache (HF_DATASETS_OFFLINE=1) or with a local dataset script/dir."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from memlab.data.base import limit, register
from memlab.data.formats import RowOptions
from memlab.registry import PositiveInt, Seed
from memlab.trainer.inputs import Inputs, content_key

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("hub")
@dataclass(kw_only=True)
class Hub(RowOptions):
    """Arguments of ``datasets.load_dataset``."""

    path: str = "trl-lib/Capybara"
    """Hub dataset id (or a local dataset script / directory), as datasets.load_dataset's path."""
    config_name: str | None = None
    """The dataset configuration (datasets.load_dataset(path, name=...))."""
    split: str = "train"
    """Split to train on (e.g. train, or a slice such as train[:10%])."""
    revision: str | None = None
    """Hub branch, tag or commit of the dataset (None: the default branch)."""
    data_dir: str | None = None
    """Sub-directory of the dataset repository to read."""
    cache_dir: str | None = None
    """Where ``datasets`` caches hub datasets (None: its default, ``HF_DATASETS_CACHE``); with
    ``HF_DATASETS_OFFLINE=1`` a dataset is read from there without the network. A local dataset
    directory is cached under ``memlab-by-content/sha256-<its files' hash>`` there."""
    max_examples: PositiveInt | None = None
    """Keep only this many rows (a seeded sample when shuffle_seed is set)."""
    shuffle_seed: Seed | None = None
    """Seed of the sample that max_examples keeps (None: the first rows)."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = self.row_errors()
        if not self.path:
            errors.append("data.path must name a hub dataset, e.g. trl-lib/Capybara")
        return errors

    def place(self, index: int) -> str:
        name = f"{self.path}" + (f" ({self.config_name})" if self.config_name else "")
        return f"{name} split {self.split!r} row {index}"

    def as_split_source(self) -> Hub:
        """A hub dataset has named splits (``data.eval=test`` reads one)."""
        return self

    def inputs(self) -> dict[str, Inputs]:
        """A local dataset directory or script: its files; a hub dataset: the commit its
        revision resolved to (the hub cache's record of it)."""
        local = Path(self.path).expanduser()
        if local.exists():
            return {"data": Inputs.of_paths([local])}
        return {"data": Inputs(repo=f"datasets/{self.path}", revision=self.revision)}

    def _cache_for_content(self) -> str | None:
        """``cache_dir``; for a local dataset directory, a directory under it named by the
        SHA-256 of the directory's files (``datasets`` keys a local file by its path and
        modification time, which ``rsync -a`` or ``cp -p`` keep across a change)."""
        files = self.inputs()["data"].files
        if not files:
            return self.cache_dir
        import datasets

        base = Path(self.cache_dir or datasets.config.HF_DATASETS_CACHE).expanduser()
        return str(base / "memlab-by-content" / f"sha256-{content_key(files)}")

    def load(self, ctx: BuildContext):
        return self.load_split(ctx, self.split)

    def load_split(self, ctx: BuildContext, split: str):
        """The rows of ``split`` of this dataset (``data.eval=<split>``: the held-out rows),
        ``max_examples`` of them at most."""
        import datasets

        ds = datasets.load_dataset(
            self.path, self.config_name, split=split, revision=self.revision,
            data_dir=self.data_dir, cache_dir=self._cache_for_content(),
        )
        return limit(ds, self.max_examples, self.shuffle_seed)
