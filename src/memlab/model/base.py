"""What a model option provides (:class:`Model`, in :mod:`memlab.protocols` and re-exported
here with :data:`Head`) and the loading steps every option shares: attention + dtype at load
time, the right head, use_cache off."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from memlab import registry
from memlab.protocols import Head, Model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from memlab.protocols import BuildContext

ModelClass = TypeVar("ModelClass", bound=Model)


def register(name: str) -> Callable[[type[ModelClass]], type[ModelClass]]:
    """Register a ``model=`` option (mypy checks it against :class:`Model`)."""
    return registry.register("model", name)

def auto_class(head: Head):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if head == "causal_lm" else AutoModelForSequenceClassification


def finish_load(model: PreTrainedModel, tokenizer: Any, head: Head) -> PreTrainedModel:
    """Settings every loaded model gets: no KV cache in training, pad id for classification."""
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = False
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def load_kwargs(ctx: BuildContext, extra: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for from_pretrained / from_config: attention backend and dtype."""
    kw: dict[str, Any] = {
        "attn_implementation": ctx.attention.implementation(),
        "dtype": ctx.precision.torch_param_dtype(),
    }
    kw.update(extra)
    return kw


def seeded(seed: int):
    """Context for a reproducible random init."""
    return torch.random.fork_rng(devices=[]) if seed is None else _Seeded(seed)


class _Seeded:
    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=[])
        self._fork.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        return self._fork.__exit__(*exc)
