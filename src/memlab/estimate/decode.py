"""The estimate's shortened decode: prefill, the first and the last decode step, not one fake
forward per new token.

Why it is exact: an online method generates with transformers' ``generate`` (KV cache); every
decode step between the first and the last runs the same ops as the last one on a shorter
cache, so its memory is below the last step's, and the generate phase's peak is set by the
prefill, the first decode step (the first growth of the cache built by prefill) or the last
one (the cache at full length). :class:`ShortDecode` lets ``generate``'s own loop run every
step (its growing token ids, attention mask, sampling and stop check are the run's, tensor for
tensor) but answers the model's forward of the steps in between without running the model: the
output's logits (one ``[rows, 1, vocab]`` tensor, as the first step returned) and the cache as
it was. Before the last step it grows every layer of the cache to the length the skipped steps
would have left (its own ``update``, with fake keys and values: no data), so the last step runs
on the cache at full length, as in the run; the growth holds less memory at once than the last
step's own update of the same layers.

FLOPs (``memlab fit``'s speed model): a decode step's count is affine in the cache length (the
projections and the output head: constant; attention over the cache: linear), so the skipped
steps add up to ``(steps - 2) x (first + last) / 2``, computed from the counts of the first and
the last step (their shapes). The value reads the fake mode answers (notes) are counted the same
way: the first step's, once per skipped step.

The shortcut applies where every cache layer is transformers' plain ``DynamicLayer`` (full
attention, grown by concatenation); a sliding-window or other cache layer decodes step by step.
``tests/unit/estimate/test_decode.py`` checks the shortened estimate against the step-by-step one
(every category and phase, the FLOPs) for every online method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memlab.measure import patches
from memlab.trainer.routing import base_model, unwrap


class ShortDecode:
    """The decode-step seam of :class:`memlab.estimate.standins.WorstCaseEngine` (module
    docstring). ``counter``: the estimate's FLOP counter (None: not counted); ``mode``: its fake
    mode (its ``assumed`` value reads are counted for the skipped steps);
    ``every_step``: run every decode step (the reference the shortcut is tested against)."""

    def __init__(self, counter: Any = None, mode: Any = None, every_step: bool = False):
        self.counter = counter
        self.mode = mode
        self.every_step = every_step
        self.skipped = 0
        """Decode steps answered without the model so far (all generate calls)."""
        self.on_grow: Callable[[int, int], None] | None = None
        """Called with (layer, layers) before each layer of the cache grows
        (:mod:`memlab.estimate.layers` labels the growth layer by layer)."""

    @contextlib.contextmanager
    def around(self, model: nn.Module, new_tokens: int) -> Iterator[None]:
        """For one ``generate`` call on ``model`` (wrapped or not) of ``new_tokens`` tokens a
        row: the model's forward of decode steps 2 .. n - 2 is skipped (module docstring). A
        decode step is a forward of one token a row on a cache; the first one, after prefill,
        is step 1."""
        if self.every_step or new_tokens < 4:
            yield
            return
        hf = base_model(unwrap(model))
        state = _Steps(self, new_tokens)
        with patches.forward_replaced(hf, state.forward):
            yield


class _Steps:
    """One generate call's decode steps (:meth:`ShortDecode.around`)."""

    def __init__(self, owner: ShortDecode, new_tokens: int):
        self.owner = owner
        self.last = new_tokens - 1  # decode step k makes token k + 1; prefill made token 1
        self.step = 0
        self.start = 0
        self.shortcut = False
        self.logits: tuple[tuple[int, ...], torch.dtype] | None = None
        self.output_type: Any = None
        self.first_flops = 0
        self.first_reads: dict[str, int] = {}

    def _flops(self) -> int:
        counter = self.owner.counter
        return 0 if counter is None else counter.total

    def _reads(self) -> dict[str, int]:
        mode = self.owner.mode
        return dict(getattr(mode, "assumed", None) or {})

    def forward(self, original, *args: Any, **kwargs: Any) -> Any:
        ids, cache = kwargs.get("input_ids"), kwargs.get("cache")
        if args or ids is None or cache is None or ids.shape[1] != 1:
            return original(*args, **kwargs)  # prefill, or a call this seam does not know
        self.step += 1  # decode step k (one new token a row): the cache holds start + k - 1
        step = self.step
        if step == 1:
            self.start = cache.get_seq_length()
            flops, reads = self._flops(), self._reads()
            out = original(*args, **kwargs)
            self.first_flops = self._flops() - flops
            after = self._reads()
            self.first_reads = {k: n - reads.get(k, 0) for k, n in after.items()}
            self.shortcut = _growable(cache) and out.logits.shape[1] == 1
            self.logits = (tuple(out.logits.shape), out.logits.dtype)
            self.output_type = type(out)
            return out
        if not self.shortcut or not 1 < step <= self.last:
            return original(*args, **kwargs)
        if step < self.last:  # a step between the first and the last: not run
            self.owner.skipped += 1
            assert self.logits is not None and self.output_type is not None  # set by step 1
            shape, dtype = self.logits
            logits = torch.empty(shape, dtype=dtype, device=ids.device)
            return self.output_type(logits=logits, cache=cache)
        _grow(cache, self.start + step - 1, self.owner.on_grow)
        flops = self._flops()
        out = original(*args, **kwargs)
        skipped = self.last - 2
        if self.owner.counter is not None:
            self.owner.counter.total += skipped * (self.first_flops + self._flops() - flops) // 2
        mode = self.owner.mode
        if mode is not None and self.first_reads:
            for k, n in self.first_reads.items():
                mode.assumed[k] = mode.assumed.get(k, 0) + skipped * n
        return out


def _growable(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a plain ``DynamicLayer`` (grown by concatenation)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized
                                for layer in layers)


def _grow(cache: Any, length: int, on_grow: Callable[[int, int], None] | None = None) -> None:
    """Every layer of ``cache`` grown to ``length`` positions by its own ``update`` (fake keys
    and values of the missing positions); ``on_grow(i, layers)`` before layer ``i``."""
    for i, layer in enumerate(cache.layers):
        if on_grow is not None:
            on_grow(i, len(cache.layers))
        keys, values = layer.keys, layer.values
        missing = length - keys.shape[-2]
        if missing > 0:
            layer.update(keys.new_empty((*keys.shape[:-2], missing, keys.shape[-1])),
                         values.new_empty((*values.shape[:-2], missing, values.shape[-1])))
