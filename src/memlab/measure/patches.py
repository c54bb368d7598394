"""Every change memlab makes to third-party code, in one place.

memlab patches no module of its own. Where it must change what a library does, the change is
made here, scoped (a context manager that restores the original on exit), and checked: the
target must exist as memlab expects it, or :class:`PatchTargetMissing` names it and the installed
version, so an upgrade that renames a function fails loudly instead of silently turning the
patch into a no-op.

- :func:`recording_multi_grad_hooks` (the run's memory tracker): torch's module tracker leaves
  one multi-grad hook per module input behind; memlab records them to remove them (and
  registers none under ``no_grad``, where no backward can fire them).
- :func:`stop_at_length` (``memlab estimate``): transformers' decoding loop stops when every row
  has sampled EOS, a value read; on fake tensors the estimate decodes to a given length instead.
- :func:`mask_decisions` (``memlab estimate``): two value-dependent decisions of transformers'
  mask construction (is this a packed row? is the padding mask all ones?) answered by the
  estimator from the real batch.
- :func:`forward_replaced` (``memlab estimate``): one model instance's ``forward`` goes through
  the estimator first (the shortened decode answers the decode steps it skips).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

_MISSING = object()


class PatchTargetMissing(RuntimeError):
    """A third-party attribute memlab patches is not where memlab expects it."""


def _version(owner: Any) -> str:
    from importlib.metadata import PackageNotFoundError, version

    root = (getattr(owner, "__module__", None) or getattr(owner, "__name__", "?")).split(".")[0]
    try:
        return f"{root} {version(root)}"
    except PackageNotFoundError:
        return root


def check_target(owner: Any, name: str) -> Any:
    """The current value of ``owner.name``; :class:`PatchTargetMissing` if there is none."""
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        raise PatchTargetMissing(
            f"memlab patches {where}.{name}, which the installed {_version(owner)} does not "
            "have; memlab supports the versions pinned in pyproject.toml (or update "
            "memlab.measure.patches for this one)")
    return value


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Any) -> Iterator[Any]:
    """``owner.name = replacement`` for the block (checked with :func:`check_target`); yields the
    original. Restored on exit, whatever happens inside."""
    original = check_target(owner, name)
    own = vars(owner).get(name, _MISSING)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        if own is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


class _NoHook:
    """The handle of a hook that was not registered."""

    def remove(self) -> None:
        return None


@contextlib.contextmanager
def recording_multi_grad_hooks() -> Iterator[list]:
    """Every hook torch's ModTracker registers with ``register_multi_grad_hook`` inside the block
    is appended to the yielded list (the caller removes them). Under ``torch.no_grad`` none is
    registered: no backward can reach it, and its closure would keep a leaf input alive until
    the step ends (transformers' ``enable_input_require_grads`` makes each generate forward's
    embedding output one: one hidden state per decode step, held through the training step)."""
    import torch
    from torch.distributed._tools import mod_tracker

    handles: list = []
    real = check_target(mod_tracker, "register_multi_grad_hook")

    def recording(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return _NoHook()
        handle = real(*args, **kwargs)
        handles.append(handle)
        return handle

    with patched(mod_tracker, "register_multi_grad_hook", recording):
        yield handles


@contextlib.contextmanager
def stop_at_length(stop_at: Callable[[], int]) -> Iterator[None]:
    """transformers' decoding loop stops once the sequences reach ``stop_at()`` tokens, instead of
    reading whether every row has finished."""
    from transformers.generation import utils as gen_utils

    def stop(self, unfinished_sequences, tokens, length):
        return length >= stop_at()

    with patched(check_target(gen_utils, "StopCheck"), "__call__", stop):
        yield


@contextlib.contextmanager
def mask_decisions(find_packed: Callable[[Callable, Any], Any],
                   ignore_causal: Callable[..., bool]) -> Iterator[None]:
    """transformers' ``find_packed_sequence_indices(position_ids)`` becomes
    ``find_packed(original, position_ids)`` and ``_ignore_causal_mask_sdpa(padding_mask, ...)``
    becomes ``ignore_causal(original, padding_mask, ...)``."""
    from transformers import masking_utils as mu

    orig_find = check_target(mu, "find_packed_sequence_indices")
    orig_skip = check_target(mu, "_ignore_causal_mask_sdpa")
    with patched(mu, "find_packed_sequence_indices",
                 lambda position_ids: find_packed(orig_find, position_ids)), \
            patched(mu, "_ignore_causal_mask_sdpa",
                    lambda *a, **k: ignore_causal(orig_skip, *a, **k)):
        yield


@contextlib.contextmanager
def forward_replaced(module: Any, replacement: Callable[..., Any]) -> Iterator[None]:
    """``module.forward(*args, **kwargs)`` becomes ``replacement(original, *args, **kwargs)``
    for the block, on this instance only (its class and every other instance keep theirs). The
    replacement keeps the original's signature: transformers reads it (``generate`` passes
    ``logits_to_keep`` only to a forward that takes it)."""
    original = check_target(module, "forward")

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return replacement(original, *args, **kwargs)

    with patched(module, "forward", forward):
        yield
