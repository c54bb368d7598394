"""Reward functions for the online methods (``method=grpo``), by name; reward models
(:class:`RewardModel`); reward groups that train nothing (:func:`reward_groups`).

A reward function scores a batch of completions, one float each::

    def my_reward(completions: list[str], *, prompts: list[str], references: list[str],
                  completion_ids: list[list[int]], finished: list[bool]) -> list[float]

``method.rewards`` lists built-in names (below) or ``package.module:function`` import paths of
your own; ``method.reward_weights`` weights them (default 1 each). ``references`` is the
dataset's answer for the prompt (the conversation's last assistant turn, or a preference row's
chosen completion); ``finished`` says whether the completion ended with EOS before
``max_completion_length``.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memlab.trainer.routing import base_model

RewardFn = Callable[..., list[float]]


def length(target: int) -> RewardFn:
    """``-|n - target| / target`` for a completion of ``n`` tokens: peaks at the target length."""

    def fn(completions: list[str], *, completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [-abs(len(ids) - target) / target for ids in completion_ids]

    fn.__name__ = "length"
    return fn


def finished(completions: list[str], *, finished: list[bool], **_: Any) -> list[float]:
    """1 when the completion ended with EOS inside ``max_completion_length``, else 0."""
    return [1.0 if f else 0.0 for f in finished]


_WORD = re.compile(r"\w+")


def reference_f1(completions: list[str], *, references: list[str], **_: Any) -> list[float]:
    """Word-level F1 overlap between the completion and the reference answer (0 to 1)."""
    out = []
    for text, ref in zip(completions, references, strict=True):
        a, b = Counter(_WORD.findall(text.lower())), Counter(_WORD.findall((ref or "").lower()))
        common = sum((a & b).values())
        if common == 0:
            out.append(0.0)
            continue
        p, r = common / sum(a.values()), common / sum(b.values())
        out.append(2 * p * r / (p + r))
    return out


BUILTIN = ("length", "finished", "reference_f1")


def resolve(name: str, method: Any) -> RewardFn:
    """A built-in by name, or ``module:function``; raises ValueError naming the choices."""
    if name == "length":
        return length(method.target_length)
    if name == "finished":
        return finished
    if name == "reference_f1":
        return reference_f1
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"method.rewards: cannot import {name!r} ({e})") from None
        if not callable(fn):
            raise ValueError(f"method.rewards: {name!r} is not callable")
        return fn
    raise ValueError(f"method.rewards: unknown reward {name!r}; built-in: {', '.join(BUILTIN)}, "
                     "or 'package.module:function' for your own")


def reward_groups(rewards: torch.Tensor, group: int) -> dict[str, int]:
    """The rollout's reward groups (``groups``: prompts, ``group`` completions each) and those
    whose rewards have zero variance (``hollow_groups``): every completion of such a group gets
    the same reward, so a group-relative advantage is zero and the group trains nothing. The
    trainer sums them over the run (``Batch.meta["counts"]``; the summary's ``data``). Nothing
    for groups of one completion."""
    if group < 2:
        return {}
    by_group = rewards.detach().float().reshape(-1, group)
    same = (by_group.max(dim=1).values == by_group.min(dim=1).values)
    return {"groups": int(by_group.shape[0]), "hollow_groups": int(same.sum())}


class RewardModel(nn.Module):
    """A frozen reward model with its own tokenizer: :meth:`score` reads texts (the prompt's
    rendering + the completion's text, no extra special tokens) and returns the head's output at
    each text's last real token."""

    def __init__(self, model: nn.Module, tokenizer):
        super().__init__()
        self.model = model
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        self.tokenizer = tokenizer
        base_model(model).config.pad_token_id = tokenizer.pad_token_id  # its own tokenizer's

    def forward(self, **inputs: torch.Tensor) -> Any:
        return self.model(**inputs)

    def score(self, texts: list[str]) -> torch.Tensor:
        """Scores ``[N]`` (float32, host), no gradient, eval mode."""
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        device = next(self.model.parameters()).device
        with torch.no_grad():
            logits = self.model(input_ids=enc["input_ids"].to(device),
                                attention_mask=enc["attention_mask"].to(device)).logits
        return logits[:, 0].float().cpu()
