"""`method=reward`: a Bradley-Terry reward model on preference pairs.

The model is a sequence-classification head with one output (``head = "seq_cls"``): the
reward of a sequence is the head's output at its last token. Rows: ``chosen`` + ``rejected``
with an optional ``prompt`` (conversational or strings; without a prompt each is a whole
conversation / text) and an optional per-pair ``margin`` (Llama-2 style required gap).

Sequences longer than ``max_length``: ``truncation_mode=drop`` drops the pair (as TRL does:
cutting the end would move the token the reward is read at), ``keep_end`` keeps the last
``max_length`` tokens. Both are counted (examples_dropped / tokens_dropped).

Batches: the B chosen and B rejected sequences go through ONE forward, padded ``[2B, T]`` (right
padding; transformers pools the last non-pad token of each row) or padding-free (one ``[1, N]``
row with restarting position_ids; the decoder runs once and the score head is applied at the last
non-pad token of every sequence - the same token transformers would pick).

Packing (``packing=bfd | bfd_split``, :mod:`memlab.packing.groups`): the unit is the pair; a
micro-batch is ``train.batch_size`` rows of at most ``max_length`` tokens, both sequences of a
pair in the same micro-batch. ``bfd`` places each pair whole in one row; a pair that does not
fit is dropped (``truncation_mode=drop``) or both sequences keep their last ``k`` tokens, ``k``
the largest that fits the pair (as if unshared) in one row (``keep_end``), counted.
``bfd_split`` puts a pair too long for one row into two rows of the same micro-batch.
``share_prompt``: the two sequences' common start (their longest common token prefix: the
prompt, and any identical tokens after it; at least the last token of each stays its own) is
stored once; each sequence's rest sees it and itself only. The rewards equal the unshared ones.

``loss()`` returns the Bradley-Terry loss SUMMED over pairs (``num_items`` = pairs), plus
``center_rewards_coefficient * (r_c + r_r)^2`` per pair when set. Metrics: accuracy
(r_chosen > r_rejected), rewards/margins, rewards/chosen, rewards/rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import torch
from torch import nn

from memlab.data.base import DataError
from memlab.method import _layout, _rows
from memlab.method._knobs import PaddingFree, PadMultiple, SharePrompt
from memlab.method.base import Batch, DataStats, Offline, RowLayout, model_inputs, register
from memlab.model.base import Head
from memlab.registry import NonNegativeFloat, Range
from memlab.trainer.routing import base_model, call_inside

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.packing.groups import GroupPacked


@register("reward")
@dataclass(kw_only=True)
class Reward(Offline, SharePrompt, PadMultiple, PaddingFree):
    """Reward-model knobs, named as in TRL's RewardConfig where one exists."""

    max_length: Annotated[int, Range(ge=2)] | None = 1024
    """Longest chosen / rejected sequence. None = no limit."""
    truncation_mode: Literal["drop", "keep_end"] = "drop"
    """drop: pairs with a longer sequence are dropped; keep_end: keep the last max_length tokens."""
    center_rewards_coefficient: NonNegativeFloat | None = None
    """Weight of the auxiliary (r_c + r_r)^2 term that keeps rewards centred (null = off)."""
    use_margin: bool = True
    """Subtract the dataset's per-pair 'margin' column (when it has one) from r_c - r_r."""

    data_kinds: ClassVar[tuple[str, ...]] = ("preference",)
    head: ClassVar[Head] = "seq_cls"
    items_name: ClassVar[str] = "pairs"
    eval_metrics: ClassVar[tuple[str, ...]] = (
        "loss", "accuracy", "rewards/margins", "rewards/chosen", "rewards/rejected")

    # ------------------------------------------------------------------ capabilities
    def row_layout(self, ctx: BuildContext) -> RowLayout:
        return RowLayout(supports_packing=True, supports_padding_free=True,
                         packs_rows=self.padding_free or self.share_prompt or ctx.packing.packs,
                         row_length=self.max_length, pad_to_multiple_of=self.pad_to_multiple_of,
                         keeps_row_end=self.truncation_mode == "keep_end")

    def as_group_packed(self) -> GroupPacked | None:
        return self

    def unit_pieces(self) -> int:
        return 2

    # ------------------------------------------------------------------ validation
    def validate(self, ctx: BuildContext) -> list[str]:
        errors = _rows.length_errors({"max_length": self.max_length})
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            errors.append("method.center_rewards_coefficient must be >= 0 or null")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of <= 0:
            errors.append("method.pad_to_multiple_of must be a positive integer or null")
        errors += _layout.layout_errors(self, ctx)
        return errors

    # ------------------------------------------------------------------ data
    def prepare(self, ds, tokenizer, ctx: BuildContext) -> tuple[Any, DataStats]:
        """Rows: chosen_ids, rejected_ids (whole sequences) [, margin]."""
        cols = set(ds.column_names)
        if not {"chosen", "rejected"} <= cols:
            raise DataError("method=reward needs rows with 'chosen' and 'rejected' (and "
                            f"optionally 'prompt', 'margin'); this dataset has columns "
                            f"{sorted(cols)}")
        has_prompt = "prompt" in cols
        margin = self.use_margin and "margin" in cols
        limit, mode = self.max_length, self.truncation_mode
        row_cap = _layout.unit_row(ctx, limit)  # packing=bfd: a pair fills one row
        fit = row_cap is not None
        shared = self.share_prompt

        def fn(row: dict, idx: int) -> list[dict]:
            prompt = row["prompt"] if has_prompt else None
            tools = row.get("tools")
            # a field far longer than the last max_length tokens is cut before tokenizing
            c, n_c = _rows.encode_full(tokenizer, prompt, row["chosen"], idx, "chosen", tools,
                                       limit)
            r, n_r = _rows.encode_full(tokenizer, prompt, row["rejected"], idx, "rejected",
                                       tools, limit)
            n_in = len(c) + len(r)
            empty = int(_rows.is_empty(row["chosen"])) + int(_rows.is_empty(row["rejected"]))
            out: dict[str, Any] = {"chosen_ids": c, "rejected_ids": r, "keep": True,
                                   "n_in": n_in, "n_dropped": 0, "margin": 0.0,
                                   "n_empty": empty, "n_cut": n_c + n_r}
            if margin:
                m = row["margin"]
                if isinstance(m, bool) or not isinstance(m, (int, float)):
                    raise DataError(f"row {idx}: field 'margin' must be a number, got {m!r}")
                out["margin"] = float(m)
            full_c, full_r, common = c, r, common_prefix(c, r) if shared else 0
            n_in = out["n_in"] = n_in - common
            if limit is not None and max(len(c), len(r)) > limit:
                if mode == "drop":
                    out.update(chosen_ids=[], rejected_ids=[], keep=False, n_dropped=n_in,
                               n_empty=0, n_train=0)
                    return [out]
                c, r = c[-limit:], r[-limit:]
            if row_cap is not None and pair_tokens(c, r, shared) > row_cap:
                if mode == "drop":
                    out.update(chosen_ids=[], rejected_ids=[], keep=False, n_dropped=n_in,
                               n_empty=0, n_train=0)
                    return [out]
                back = _rows.fit_row(0, [c[::-1], r[::-1]], row_cap, False)
                if back is None:  # (a row holds at least two tokens: max_length >= 2)
                    raise ValueError(f"row {idx}: the pair does not fit a row of {row_cap} tokens")
                c, r = back[0][0][::-1], back[0][1][::-1]
            cut_c, cut_r = len(full_c) - len(c), len(full_r) - len(r)  # from the start
            out.update(chosen_ids=c, rejected_ids=r,
                       n_dropped=cut_c + cut_r - min(cut_c, cut_r, common))
            # tokens kept (the shared prompt once), less those of a blank completion
            empty_c, empty_r = _rows.is_empty(row["chosen"]), _rows.is_empty(row["rejected"])
            out["n_train"] = (0 if empty_c and empty_r else len(r) if empty_c
                              else len(c) if empty_r else n_in - out["n_dropped"])
            return [out]

        key = ("reward", has_prompt, margin, limit, mode, fit, shared, tokenizer.name_or_path,
               len(tokenizer))
        out, stats = _rows.kept(_rows.map_rows(
            ds, fn, ("chosen_ids", "rejected_ids", "margin", "keep", *_rows.TALLY), key,
            "tokenize pairs"), drop=() if margin else ("margin",))
        stats.hollow_rows, stats.hollow_what = _rows.same_pairs(out), _rows.SAME_PAIRS
        return out, stats

    def unit_sizes(self, ds, ctx: BuildContext) -> tuple[list[int], list[list[int]]]:
        """A pair in one row (the common start once with ``share_prompt``), and its two
        sequences."""
        whole, pieces = [], []
        for c, r in zip(ds["chosen_ids"], ds["rejected_ids"], strict=True):
            whole.append(pair_tokens(c, r, self.share_prompt))
            pieces.append([len(c), len(r)])
        return whole, pieces

    # ------------------------------------------------------------------ batches
    def collate(self, rows: list[dict], tokenizer, ctx: BuildContext) -> Batch:
        pad = tokenizer.pad_token_id
        units, rows_of = _layout.units_of(rows)
        if rows_of is not None or self.share_prompt:
            return self._collate_layout(units, rows_of, pad)
        seqs = [(r["chosen_ids"], [0] * len(r["chosen_ids"])) for r in rows]
        seqs += [(r["rejected_ids"], [0] * len(r["rejected_ids"])) for r in rows]
        t, real, total = _layout.collate_sequences(seqs, pad, self.pad_to_multiple_of,
                                                    self.padding_free)
        del t["labels"]
        if self.padding_free:
            t["last_index"] = self._last_non_pad(seqs, pad)
        if "margin" in rows[0]:
            t["margin"] = torch.tensor([float(r["margin"]) for r in rows], dtype=torch.float32)
        key = (total,) if self.padding_free else (total, t["input_ids"].shape[1])
        return Batch(t, num_items=len(rows), real_tokens=real, total_tokens=total, size_key=key,
                     meta={"samples": len(rows)})

    def _collate_layout(self, units: list[dict], rows_of: list[list[int]] | None,
                        pad: int | None) -> Batch:
        """Packed rows or shared starts; ``last_index``: the flat position of the token each
        sequence's reward is read at (its last non-pad token, as transformers pools)."""
        b = len(units)
        rows_of = rows_of or [[i] for i in range(b)]
        docs = []
        for i, (u, rows) in enumerate(zip(units, rows_of, strict=True)):
            c, r = u["chosen_ids"], u["rejected_ids"]
            n = common_prefix(c, r) if self.share_prompt and len(rows) == 1 else 0
            pools = [int(self._last_non_pad([(c, c)], pad)[0]),
                     int(self._last_non_pad([(r, r)], pad)[0])]
            docs.append(_layout.unit_docs(c[:n], [c[n:], r[n:]], [i, b + i], shared=n > 0,
                                          scored=False, pools=pools))
        t, real, total = _layout.collate_rows(_layout.place(docs, rows_of),
                                              0 if pad is None else pad,
                                              self.pad_to_multiple_of, self.padding_free,
                                              num_seqs=2 * b)
        for k in ("labels", "segment_ids", "fork_index", "fork_labels", "fork_segments"):
            del t[k]
        if "margin" in units[0]:
            t["margin"] = torch.tensor([float(u["margin"]) for u in units], dtype=torch.float32)
        key = (total,) if self.padding_free else (total, t["input_ids"].shape[1])
        return Batch(t, num_items=b, real_tokens=real, total_tokens=total, size_key=key,
                     meta={"samples": b})

    @staticmethod
    def _last_non_pad(seqs: list[tuple[list[int], list[int]]], pad: int | None) -> torch.Tensor:
        """Flat position of each sequence's last token that is not the pad id (the token
        transformers pools when the rows are padded; pad == eos tokenizers make it differ from
        the very last token)."""
        out, start = [], 0
        for ids, _ in seqs:
            last = len(ids) - 1
            while last > 0 and ids[last] == pad:
                last -= 1
            out.append(start + last)
            start += len(ids)
        return torch.tensor(out)

    # ------------------------------------------------------------------ loss
    def rewards(self, model: nn.Module, t: dict[str, torch.Tensor], attention: Any = None
                ) -> torch.Tensor:
        """One scalar reward per sequence, ``[S]``."""
        if "segments" not in t:
            out = model(**model_inputs(t), use_cache=False).logits
            return out.reshape(-1).float()
        scores = call_inside(model, _packed_scores, t["last_index"],
                             **_layout.document_inputs(t, "", attention))
        return scores.reshape(-1).float()

    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        from memlab.losses import bradley_terry_loss

        b = batch.num_items
        r = self.rewards(models["policy"], batch.tensors, _layout.attention_of(ctx))
        rc, rr = r[:b], r[b:]
        mean_loss = bradley_terry_loss(rc, rr, margin=batch.tensors.get("margin"),
                                       center_rewards_coefficient=self.center_rewards_coefficient)
        rc, rr = rc.detach(), rr.detach()
        metrics = {
            "accuracy": float((rc > rr).float().mean()),
            "rewards/margins": float((rc - rr).mean()),
            "rewards/chosen": float(rc.mean()),
            "rewards/rejected": float(rr.mean()),
        }
        return mean_loss * b, metrics


def _packed_scores(model: nn.Module, last_index: torch.Tensor, **inputs: torch.Tensor
                   ) -> torch.Tensor:
    """Scores of padding-free / packed rows: the decoder once, the score head only at each
    sequence's last token (``last_index``: flat positions over the rows; run inside a
    distributed wrapper by ``call_inside``)."""
    base = base_model(model)
    decoder = getattr(base, base.base_model_prefix)
    score = getattr(base, "score", None)
    if score is None:
        raise TypeError(f"method.padding_free=true for method=reward applies the model's "
                        f"'score' head itself; {type(base).__name__} has none")
    hidden = decoder(**inputs, use_cache=False).last_hidden_state
    return score(hidden.reshape(-1, hidden.shape[-1])[last_index])


def common_prefix(chosen: list[int], rejected: list[int]) -> int:
    """Tokens the two sequences share at their start, leaving at least one of each its own."""
    n, most = 0, min(len(chosen), len(rejected)) - 1
    while n < most and chosen[n] == rejected[n]:
        n += 1
    return n


def pair_tokens(chosen: list[int], rejected: list[int], shared: bool) -> int:
    """Tokens of a pair in one row: both sequences, their common start once when ``shared``."""
    return len(chosen) + len(rejected) - (common_prefix(chosen, rejected) if shared else 0)
