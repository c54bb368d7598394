"""The row-layout knobs of the methods: one mixin per concern, each knob declared here once with
its docstring, mixed into the method configs (as :class:`memlab.method._liger.LigerKnobs` is).

Not an option of its own.

    PromptLength      max_prompt_length           dpo, kto, gkd; online (256)
    CompletionLength  max_completion_length       dpo, kto; online (64, never None)
    PaddingFree       padding_free                dpo, kto, reward, online; sft (None)
    PadMultiple       pad_to_multiple_of          sft, dpo, kto, reward
    SharePrompt       share_prompt                dpo, kto, reward; online (None)
    HeadOn            head_on, padding_mask       sft, dpo, kto, online

A method whose default (in parentheses) differs re-declares the field with its default and no
docstring; the docs' reference reads the docstring here for every method that has the knob.
``max_length`` stays with each method: its default and meaning differ (a padded sequence or a
packed row, a pair's sequences, prompt + completion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memlab.registry import PositiveInt


@dataclass(kw_only=True)
class PromptLength:
    """Where the prompt is cut."""

    max_prompt_length: PositiveInt | None = 512
    """Prompt tokens kept, cut from the left (its end, next to the answer, is kept). None = no
    limit."""


@dataclass(kw_only=True)
class CompletionLength:
    """Where a completion ends."""

    max_completion_length: PositiveInt | None = None
    """Completion tokens: a dataset's completion is cut to its start (None = no limit); an
    online method samples at most this many (generation stops there or at the end-of-sequence
    token)."""


@dataclass(kw_only=True)
class PaddingFree:
    """Whether a batch is one row of documents."""

    padding_free: bool = False
    """Every sequence of a batch as a document of one ``[1, N]`` row: position ids restarting,
    no padding (a preference batch's 2B sequences; an online rollout's ``prompt + completion``
    sequences, or with share_prompt its prompts' groups). ``method=sft``: None (its default) =
    on when packing is on, off otherwise."""


@dataclass(kw_only=True)
class PadMultiple:
    """The width padded rows are rounded to."""

    pad_to_multiple_of: PositiveInt | None = None
    """Round padded lengths (or the flat row) up to a multiple (tensor-core friendly shapes)."""


@dataclass(kw_only=True)
class SharePrompt:
    """Whether the prompt a unit's sequences share is stored once."""

    share_prompt: bool = False
    """Store a unit's prompt once, each completion seeing it and itself only, not the other
    completions: a pair's prompt for chosen and rejected (``kto``: a paired row's two examples,
    and once more for their KL sequences; ``reward``: the pair's common start), an online
    prompt's for its ``num_generations`` completions. Same log-probs as unshared rows; needs
    attention that can show a document a prefix (sdpa / eager with varlen, flex). Online
    methods: None (their default) = on where the attention option can
    (``Attention.shares_prefix``), else off."""


@dataclass(kw_only=True)
class HeadOn:
    """Which positions the model computes what only some positions need."""

    head_on: Literal["labelled", "all"] = "labelled"
    """labelled: the output head (and the loss; PPO's value head too) runs only at the positions
    that predict a trained token, which the collator lists (TRL's ``logits_to_keep``); prompt
    and padding positions get no logits. all: at every position. The same loss and gradients,
    with less compute and memory where few positions train (completion-only chat, padded
    rows)."""
    padding_mask: Literal["auto", "always"] = "auto"
    """auto: padded rows go to the model without an attention mask where the attention backend
    computes padded positions either way (eager, sdpa: ``Attention.skips_padding`` false).
    Rows are right-padded and the model is causal, so no real token ever attends to a padding
    position: the mask changes nothing a label sees, and without it sdpa takes its causal
    kernel (about half the attention work, no ``[rows, 1, T, T]`` mask, no key / value heads
    repeated for it). always: send the mask (TRL's way; what flash / flex attention get under
    auto too, as they unpad)."""


@dataclass(kw_only=True)
class PreferenceRows(HeadOn, SharePrompt, PadMultiple, PaddingFree, CompletionLength,
                     PromptLength):
    """Every row-layout knob, in this order (``dpo``, ``kto``)."""
