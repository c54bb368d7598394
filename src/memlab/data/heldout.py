"""The held-out rows a run evaluates on (``data.eval``, :class:`memlab.data.formats.RowOptions`).

Three ways to name them:

- **a fraction** (``data.eval=0.05``): that share of the rows as read (after
  ``max_examples``), at least one, chosen by a permutation with a fixed seed
  (:data:`EVAL_SEED`, not ``train.seed``: runs that differ in their seed are evaluated on the
  same rows). The training rows are the others (:func:`hold_out`), so no held-out row is ever
  trained on;
- **a path** (``data.eval=val.jsonl``, a glob or a directory): read as ``data=local`` reads
  files, with the data option's ``columns``;
- **a split** of a source that has named splits (``data=hub``: ``data.eval=test``).

Either way the rows then go through the run's own conversion, chat template, method preparation
and packing (:func:`memlab.pipeline.prepare_eval`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

from memlab.data.base import DataError, DataSource

EVAL_SEED = 20_240_601
"""The seed of the permutation that picks a fraction's held-out rows."""


class Files(DataSource, Protocol):
    """A ``data=local`` option (:class:`memlab.data.local.Local`, which builds on
    :mod:`memlab.data.formats`, which checks ``data.eval`` with this module: named here by what
    is read)."""

    def file_errors(self) -> list[str]:
        """Problems of its files found before anything is read."""
        ...


def path_errors(path: str) -> list[str]:
    """Problems of ``data.eval=<path>`` found before anything is read."""
    local = _local(path, None)
    return [e.replace("data.path=", "data.eval=").replace("data=local needs data.path",
                                                          "data.eval needs a path")
            for e in local.file_errors()]


def _local(path: str, columns: dict[str, str] | None) -> Files:
    """A ``data=local`` option reading ``path`` (looked up in the registry: ``data.local``
    builds on :mod:`memlab.data.formats`, which checks ``data.eval`` with this module)."""
    from memlab.registry import lookup

    local = cast("Callable[..., Files]", lookup("data", "local"))
    return local(path=path, columns=columns)


def held_indices(n: int, fraction: float) -> list[int]:
    """The rows (of ``n``) a fraction holds out, sorted; DataError when that leaves no row to
    train on."""
    import torch

    k = max(1, round(n * fraction))
    if k >= n:
        raise DataError(f"data.eval={fraction} holds out {k} of the {n} rows and leaves none to "
                        "train on; hold out a smaller fraction or give a file (data.eval=<file>)")
    g = torch.Generator().manual_seed(EVAL_SEED)
    return sorted(torch.randperm(n, generator=g)[:k].tolist())


def hold_out(data: Any, raw: Any) -> Any:
    """The training rows of ``raw`` (the source's rows as read): all of them, or those a
    fraction does not hold out."""
    if data.eval_kind() != "fraction":
        return raw
    held = set(held_indices(len(raw), float(data.eval)))
    return raw.select([i for i in range(len(raw)) if i not in held])


def load(data: Any, ctx: Any) -> tuple[Any, Any]:
    """``(source, rows)``: the held-out rows as read, and the data option that reads and
    locates them (the run's own, or a ``data=local`` option for a path); ``(None, None)``
    without ``data.eval``."""
    kind = data.eval_kind()
    if kind is None:
        return None, None
    if kind == "fraction":
        raw = data.load(ctx)
        return data, raw.select(held_indices(len(raw), float(data.eval)))
    splits = data.as_split_source()
    if kind == "split" and splits is not None:
        return data, splits.load_split(ctx, str(data.eval))
    local = _local(str(data.eval), data.columns)
    return local, local.load(ctx)


def describe(data: Any) -> str:
    """Where the held-out rows come from, in words (summary.json's ``eval.source``)."""
    kind = data.eval_kind()
    if kind == "fraction":
        return f"{data.eval:g} of the rows held out (seed {EVAL_SEED})"
    if kind == "split":
        return f"split {data.eval!r}"
    return f"file {data.eval}"
