"""What an online method's rollout is made of (``grpo``, ``rloo``, ``online_dpo``, ``ppo``;
the prompts of ``gkd``): the prompts, the rewards, and the training batch of the sampled
completions with the per-token values a loss reads from it.

Not an option of its own (the registry skips modules whose name starts with ``_``).

**Prompts.** Prompt rows from conversations or preference rows (:func:`prompt_rows`), their
left-padded batches (:func:`prompt_batch`), prompt + completion joined into padded rows
(:func:`join`, GKD's).

**Rewards.** A reward function scores a batch of completions, one float each::

    def my_reward(completions: list[str], *, prompts: list[str], references: list[str],
                  completion_ids: list[list[int]], finished: list[bool]) -> list[float]

``method.rewards`` lists built-in names (:data:`BUILTIN`) or ``package.module:function`` import
paths of your own; ``method.reward_weights`` weights them (default 1 each). ``references`` is
the dataset's answer for the prompt (the conversation's last assistant turn, or a preference
row's chosen completion); ``finished`` says whether the completion ended with EOS before
``max_completion_length``. Reward *models*: :class:`RewardModel`; reward groups that train
nothing: :func:`reward_groups`.

**The training batch.** It is laid out on the host from token lists (the prompts the collator
kept in ``meta``, the completions the engine copied to the host), so its shapes and its scored
positions are exact without reading a device tensor (an estimate's fake step included):

* **padded** (default): one row per completion, ``prompt + completion`` right-padded to the
  longest; without an attention mask where the backend computes padded positions anyway
  (``method.padding_mask=auto`` under eager / sdpa: :func:`memlab.method.base.drops_padding_mask`);
* **padding-free** (``method.padding_free``): every ``prompt + completion`` a document of one
  ``[1, N]`` row (position ids restarting, the row's segments);
* **shared prompt** (``method.share_prompt``): one row per prompt, the prompt stored once and its
  completions after it, each seeing the prompt and itself only (:mod:`memlab.method._layout`,
  as a preference pair's shared prompt; with ``padding_free`` every group in one row). The
  prompt's last token predicts the first token of every completion (a *fork* for all but the
  first), so the training forward and backward pay for each prompt once, not once per
  completion, with the log-probs of the unshared batch.

Scored tokens: token ``t`` of completion ``i`` is predicted by one position of the rows. The
batch lists them in completion order (:data:`~memlab.method.base.LOSS_INDEX` with their labels
and completions) and :data:`COMPLETION_INDEX` = ``i * L + t``, their cell of the ``[N, L]``
completion grid (``completion_mask``) where per-token values live: log-probs, the old log-probs
of ``num_iterations``, importance weights, a value model's values. ``head_on=labelled`` runs
the output head (and a value head) at the listed positions only; ``all`` over every position,
then reads them (the reference it is tested against).

A completion whose loss term is zero whatever the policy (its method says so: GRPO with
``beta=0`` and RLOO when its advantage is exactly 0; a truncated completion left out by
``mask_truncated_completions``) is not placed in the batch at all; a prompt with none left goes
too. The loss normaliser still counts it (it is computed before), so loss and gradients are
those of the full batch. A batch keeps at least one completion (every rank runs a forward and
a backward).
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memlab.data.base import DataError, check_messages, check_text
from memlab.losses import token_logps
from memlab.method import _layout, _overrides, _rows
from memlab.method.base import IGNORE, LOSS_INDEX, LOSS_LABELS, Batch, DataStats, head_logits
from memlab.trainer.routing import base_model, call_inside

if TYPE_CHECKING:
    from memlab.context import BuildContext

# ------------------------------------------------------------------------------------------ prompts

def prompt_rows(ds, tokenizer, limit: int | None) -> tuple[Any, DataStats]:
    """Prompt tokens (chat template with the generation prompt, cut from the left to ``limit``
    tokens) and the reference answer text, from conversations or preference rows."""
    cols = set(ds.column_names)
    if "messages" not in cols and "prompt" not in cols:
        raise DataError(f"method=grpo needs rows with 'messages' (a conversation ending in "
                        f"an assistant turn) or 'prompt' (+ optional 'chosen'); this "
                        f"dataset has columns {sorted(cols)}")

    def fn(row: dict, idx: int) -> list[dict]:
        prompt, reference = prompt_and_reference(row, idx)
        # a prompt far longer than the limit is cut before tokenizing (the same last ids)
        ids, n_cut = _rows.prompt_ids(tokenizer, prompt, idx, row.get("tools"), limit)
        n_in = len(ids)
        if limit is not None and len(ids) > limit:
            ids = ids[len(ids) - limit:]
        return [{"prompt_ids": ids, "reference": reference, "n_in": n_in, "n_cut": n_cut,
                 "prompt_text": tokenizer.decode(ids, skip_special_tokens=False)}]

    key = ("grpo", limit, tokenizer.name_or_path, len(tokenizer))
    out = _rows.map_rows(ds, fn, ["prompt_ids", "reference", "n_in", "n_cut", "prompt_text"],
                         key, "tokenize prompts")
    n_in = sum(out["n_in"])
    kept = sum(len(x) for x in out["prompt_ids"])
    extra = _rows.cut_extra(out["n_cut"])
    out = out.remove_columns(["n_in", "n_cut"])
    stats = DataStats(examples=len(ds), rows=len(out), tokens_in=n_in,
                      tokens_dropped=n_in - kept, extra=extra)
    return out, stats


def prompt_batch(rows: list[dict], tokenizer, generations: int) -> Batch:
    """Left-padded prompts ``[B, P]`` (generation appends to the right end of every row) and,
    in ``meta``, their token lists, texts and reference answers; ``generations`` completions
    are sampled per prompt."""
    pad = tokenizer.pad_token_id
    width = max(len(r["prompt_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["prompt_ids"])
        ids[i, width - n:] = torch.tensor(r["prompt_ids"], dtype=torch.long)
        mask[i, width - n:] = 1
    real = int(mask.sum())
    # the prompts' tokens drive the training rows (shared / padding-free: their sum)
    return Batch({"prompt_ids": ids, "prompt_mask": mask}, num_items=0, real_tokens=real,
                 total_tokens=ids.numel(), size_key=(len(rows), width, real),
                 meta={"samples": len(rows) * generations,
                       "prompt_ids": [list(r["prompt_ids"]) for r in rows],
                       "references": [r["reference"] for r in rows],
                       "prompts": [r["prompt_text"] for r in rows],
                       "eos": tokenizer.eos_token_id, "pad": pad,
                       "decode": tokenizer.batch_decode})


def join(prompt: torch.Tensor, prompt_mask: torch.Tensor, completion: torch.Tensor,
         completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded completions -> the training tensors: input_ids,
    attention_mask, position_ids (counting real tokens only) and labels on the completion
    tokens (``labels[t] = input_ids[t+1]``, aligned with input_ids)."""
    ids = torch.cat([prompt, completion.to(prompt.device)], 1)
    attn = torch.cat([prompt_mask, completion_mask.to(prompt_mask.device)], 1)
    labels = torch.full_like(ids, IGNORE)
    p = prompt.shape[1]
    labels[:, p - 1: -1] = completion.masked_fill(completion_mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": attn,
            "position_ids": (attn.cumsum(1) - 1).clamp(min=0), "labels": labels}


def prompt_and_reference(row: dict, idx: int) -> tuple[Any, str]:
    """(prompt, reference answer) of a conversation or a preference row."""
    if "messages" in row and row["messages"] is not None:
        msgs = row["messages"]
        check_messages(msgs, idx, "messages")
        last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
        if last is None:
            raise DataError(f"row {idx}: field 'messages' has no user turn to prompt with")
        answer = next((m["content"] or "" for m in msgs[last + 1:] if m["role"] == "assistant"),
                      "")
        return msgs[: last + 1], answer
    prompt = row.get("prompt")
    chosen = row.get("chosen")
    if isinstance(prompt, list):
        check_messages(prompt, idx, "prompt")
    elif prompt is not None:
        check_text(prompt, idx, "prompt")
    else:
        raise DataError(f"row {idx}: field 'prompt' is empty")
    if isinstance(chosen, list):
        answer = " ".join(m.get("content") or "" for m in chosen if isinstance(m, dict))
    else:
        answer = chosen or ""
    return prompt, answer

# ------------------------------------------------------------------------------------------ rewards

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


def reward_errors(method: Any, ctx: BuildContext) -> list[str]:
    """The checks of an online method's ``rewards``, ``reward_models`` and ``reward_weights``."""
    errors = []
    if not method.rewards and not method.reward_models:
        errors.append("method.rewards and method.reward_models are empty; e.g. "
                      "method.rewards=[length]")
    for name in method.rewards:
        try:
            resolve(name, method)
        except ValueError as e:
            errors.append(str(e))
    for i, entry in enumerate(method.reward_models):
        where = f"method.reward_models[{i}]"
        if not isinstance(entry, dict):
            errors.append(f"{where} must be a mapping of model-group overrides, e.g. "
                          f"{{name_or_path: my/reward-model}} (got {entry!r})")
            continue
        unknown = _overrides.override_key_errors(ctx, entry, where)
        errors += unknown
        if not unknown and entry:
            errors += _overrides.overridden_model_errors(ctx, entry, where)
    n_rewards = len(method.rewards) + len(method.reward_models)
    if method.reward_weights is not None and len(method.reward_weights) != n_rewards:
        errors.append(f"method.reward_weights has {len(method.reward_weights)} values for "
                      f"{n_rewards} rewards (functions, then models); give one weight per "
                      "reward or null")
    return errors


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

# ------------------------------------------------------------------------------- the training batch

COMPLETION_INDEX = "completion_index"
"""Batch tensor: the ``[N, L]`` completion-grid cell (``i * L + t``) of each scored token, in
the order of :data:`~memlab.method.base.LOSS_INDEX`."""

_LAYOUT_ONLY = ("labels", "segment_ids", "fork_index", "fork_labels", "fork_segments",
                "last_index")
"""Tensors of the shared collators that the online losses do not read (the scored tokens say
it all)."""


def training_tensors(prompts: list[list[int]], completions: list[list[int]], keep: list[bool],
                     group: int, pad_id: int, *, share: bool, flat: bool, mask: bool,
                     width: int | None = None) -> tuple[dict[str, Any], int, int]:
    """The training tensors of ``prompts`` (``B``) and their ``completions`` (``B * group``,
    prompt-major), placing the completions ``keep`` marks (module docstring; with none, the
    first one, unscored: its ``completion_mask`` row is 0).
    ``width``: the completion grid's width (default: the longest completion). Returns
    ``(tensors, stored tokens, token slots)``."""
    n = len(completions)
    if n != len(prompts) * group or len(keep) != n:
        raise ValueError(f"{len(prompts)} prompts x {group} completions != {n} completions "
                         f"({len(keep)} keep flags)")
    if any(not p for p in prompts):
        raise ValueError("an empty prompt predicts no first completion token")
    kept = [i for i in range(n) if keep[i]]
    placed = kept or [0]  # at least one row; unscored (its completion_mask row stays 0)
    if share:
        units = []
        for b, prompt in enumerate(prompts):
            mine = [i for i in placed if i // group == b]
            if mine:
                units.append(_layout.unit_docs(prompt, [completions[i] for i in mine], mine,
                                               shared=True))
        t, real, total = _layout.collate_rows(units, pad_id, None, flat, scored=True)
    else:
        seqs = [_layout.sequence(prompts[i // group], completions[i]) for i in placed]
        t, real, total = _layout.collate_sequences(seqs, pad_id, None, flat, scored=True,
                                                    seq_ids=placed)
        if not mask:
            t.pop("attention_mask", None)
    for k in _LAYOUT_ONLY:
        t.pop(k, None)
    width = width or max(len(c) for c in completions)
    # the collators list the kept completions in order, each one's tokens in order
    cells = [i * width + j for i in placed for j in range(len(completions[i]))]
    if len(cells) != t[LOSS_INDEX].numel():
        raise AssertionError(f"{t[LOSS_INDEX].numel()} scored positions for {len(cells)} "
                             "completion tokens")
    grid = torch.zeros((n, width), dtype=torch.long)
    for i in kept:
        grid[i, : len(completions[i])] = 1
    t[COMPLETION_INDEX] = torch.tensor(cells, dtype=torch.long)
    t["completion_mask"] = grid
    return t, real, total


def grid(values: torch.Tensor, t: dict[str, Any]) -> torch.Tensor:
    """Per-scored-token ``values`` ``[K]`` as the ``[N, L]`` completion grid (0 elsewhere)."""
    n, width = t["completion_mask"].shape
    return values.new_zeros(n * width).index_copy(0, t[COMPLETION_INDEX], values).view(n, width)


def completion_logps(model, t: dict[str, Any], labelled: bool, attention: Any = None
                     ) -> torch.Tensor:
    """``[N, L]`` fp32 log-probs of the completion tokens under ``model`` (0 where nothing is
    scored); ``labelled``: the output head runs at the scored positions only."""
    inputs = _layout.document_inputs(t, "", attention)
    logits = head_logits(model, inputs, t[LOSS_INDEX], labelled)
    return grid(token_logps(logits, t[LOSS_LABELS]), t)


def _values(model, index: torch.Tensor, labelled: bool, **inputs: Any) -> torch.Tensor:
    base = base_model(model)
    hidden = getattr(base, base.base_model_prefix)(**inputs, use_cache=False).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])
    score = base.get_submodule("score")  # the value head
    if labelled:
        return score(hidden.index_select(0, index)).squeeze(-1).float()
    return score(hidden).squeeze(-1).float().index_select(0, index)


def completion_values(model, t: dict[str, Any], labelled: bool, attention: Any = None
                      ) -> torch.Tensor:
    """``[N, L]`` a value model's output at the positions that predict the completion tokens
    (its one-output head on each hidden state, not pooled at the last token as the
    classification forward does); ``labelled``: the head runs there only."""
    inputs = _layout.document_inputs(t, "", attention)
    return grid(call_inside(model, _values, t[LOSS_INDEX], labelled, **inputs), t)
