"""A checkpoint's state as files: nested Python state (optimizer, schedule, random generators)
as plain JSON whose tensors go to a safetensors file (:func:`to_tree` / :func:`from_tree`), those
files written (hashed as they are written) and read (:func:`save_tensors` /
:func:`load_tensors`), and the error of a checkpoint that cannot be used
(:class:`CheckpointError`). :mod:`memlab.trainer.checkpoint` writes and reads checkpoints with
them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says which file and why."""


def to_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """``obj`` as plain JSON; its tensors go to ``tensors`` (referenced by key). Tuples, dicts with
    non-string keys and numpy arrays are tagged so that :func:`from_tree` restores them."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        while key in tensors:
            key += "+"
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [to_tree(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_tree(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: to_tree(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {"__items__": [[to_tree(k, tensors, f"{path}/key"),
                               to_tree(v, tensors, f"{path}/{k}")] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint: cannot store a {type(obj).__name__} (at {path or 'top'})")


def from_tree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`to_tree` (builds only tensors, arrays, tuples, lists, dicts)."""
    if isinstance(tree, list):
        return [from_tree(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        return tensors[tree["__tensor__"]]
    if "__ndarray__" in tree:
        return np.asarray(tree["__ndarray__"], dtype=np.dtype(tree["dtype"]))
    if "__tuple__" in tree:
        return tuple(from_tree(v, tensors) for v in tree["__tuple__"])
    if "__items__" in tree:
        return {_hashable(from_tree(k, tensors)): from_tree(v, tensors)
                for k, v in tree["__items__"]}
    return {k: from_tree(v, tensors) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """``tensors`` as one safetensors file, written tensor by tensor (each copied to the host on
    its own; tensors that share memory need no copy); returns its sha256, computed while it
    was written (:mod:`memlab.trainer.safetensors_writer`)."""
    from memlab.trainer.safetensors_writer import write_safetensors

    return write_safetensors(path, tensors)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` ({} when there is none); a file that cannot
    be read raises :class:`CheckpointError` naming it."""
    from safetensors.torch import load_file

    if not path.is_file():
        return {}
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file
        raise CheckpointError(f"{path} is not a readable safetensors file ({type(e).__name__}: "
                              f"{e}); the checkpoint is damaged or not memlab's") from e
