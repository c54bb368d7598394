"""`method=dpo`: Direct Preference Optimization (sigmoid), IPO and hinge, on preference pairs.

Rows: ``prompt`` + ``chosen`` + ``rejected``, conversational (lists of messages) or plain strings
(conversational rows without ``prompt`` use the shared message prefix). Order: tokenize ->
truncate (prompt from the left to ``max_prompt_length``, completions from the right to
``max_completion_length``, then the completion further so prompt + completion fits
``max_length``; an example whose prompt alone fills ``max_length`` is dropped) -> collate:
the batch's chosen and rejected sequences in ONE forward, either padded ``[2B, T]`` (chosen rows
first) or padding-free (all ``2B`` sequences in one ``[1, N]`` row with restarting
position_ids; per-sequence log-probs by segment).

Packing (``packing=bfd | bfd_split``, :mod:`memlab.packing.groups`): the unit is the pair; a
micro-batch is ``train.batch_size`` rows of at most ``max_length`` tokens, every pair's two
sequences in the same micro-batch. ``bfd`` places each pair whole in one row, cutting both
completions from the right to a common length when the pair does not fit (counted in
``data.tokens_dropped``; a pair whose prompt leaves no room is dropped); ``bfd_split`` never
cuts beyond the per-sequence limits above: a pair too long for one row goes as its two
sequences into two rows of the same micro-batch. ``share_prompt`` stores the prompt once per
pair (:mod:`memlab.method._layout`): chosen and rejected attend to it and to themselves only;
log-probs equal the unshared ones; the prompt counts once in ``data.*`` and, where it is stored
once, in tokens/s (which counts the tokens stored: a pair ``bfd_split`` had to split holds its
prompt in both rows).

The output head runs only at the positions that predict a completion token
(``head_on=labelled``: the collator lists them, a shared prompt's last position once per
completion), and right-padded rows go without their attention mask where the backend computes
padding anyway (``padding_mask=auto``): the loss and gradients of the full head and the mask.

Reference (``reference``): ``copy`` (a frozen copy of the initial policy: one more set of
weights, visible as "parameters" in the memory summary), ``adapter_disabled`` (the policy with
its LoRA adapter off: no extra weights, needs peft=lora/qlora) or ``precomputed`` (reference
log-probs computed once before training, stored as dataset columns ``ref_chosen_logps`` /
``ref_rejected_logps``; no reference in memory during training). The reference always runs under
``torch.no_grad`` in eval mode.

``loss()`` returns the SUM of per-pair losses; ``num_items`` = pairs, so the trainer's division
gives the mean over the optimizer step's pairs. Metrics (means over pairs): rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected (summed
completion log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import torch

from memlab.data.base import DataError
from memlab.method import _layout, _liger, _reference, _rows
from memlab.method._preference import PreferenceBatches
from memlab.method.base import (
    Batch,
    DataStats,
    ExtraModels,
    LigerUser,
    Offline,
    batch_key,
    drops_padding_mask,
    register,
)
from memlab.model.base import Head
from memlab.registry import PositiveFloat, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.packing.groups import GroupPacked


@register("dpo")
@dataclass(kw_only=True)
class DPO(Offline, PreferenceBatches):
    """DPO knobs, named as in TRL's DPOConfig where one exists."""

    beta: PositiveFloat = 0.1
    """KL strength / inverse temperature of the implicit reward."""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid = DPO; ipo = IPO on length-averaged log-probs; hinge = SLiC."""
    label_smoothing: Annotated[float, Range(ge=0, lt=0.5)] = 0.0
    """Conservative DPO: probability that a preference label is flipped (sigmoid only)."""
    reference: Literal["copy", "adapter_disabled", "precomputed"] = "copy"
    """copy: frozen copy of the initial policy; adapter_disabled: the policy with its LoRA adapter
    off (peft=lora/qlora); precomputed: reference log-probs computed once before training."""
    max_length: Annotated[int, Range(ge=2)] | None = 1024
    """Longest prompt + completion; the completion is cut to fit; with packing also the row
    capacity. None = no limit."""

    data_kinds: ClassVar[tuple[str, ...]] = ("preference",)
    head: ClassVar[Head] = "causal_lm"
    trains_extra_models: ClassVar[bool] = False
    items_name: ClassVar[str] = "pairs"
    eval_metrics: ClassVar[tuple[str, ...]] = (
        "loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
        "logps/chosen", "logps/rejected")

    # ------------------------------------------------------------------ capabilities
    def as_extra_models(self) -> ExtraModels | None:
        return self

    def as_group_packed(self) -> GroupPacked | None:
        return self

    def as_liger(self) -> LigerUser | None:
        return self

    def unit_pieces(self) -> int:
        return 2

    # ------------------------------------------------------------------ validation
    def validate(self, ctx: BuildContext) -> list[str]:
        errors = []
        if self.beta <= 0:
            errors.append(f"method.beta must be > 0 (got {self.beta})")
        if not 0.0 <= self.label_smoothing < 0.5:
            errors.append(f"method.label_smoothing must be in [0, 0.5) (got "
                          f"{self.label_smoothing})")
        if self.label_smoothing and self.loss_type != "sigmoid":
            errors.append(f"method.label_smoothing applies to loss_type=sigmoid only, not "
                          f"{self.loss_type}; set method.label_smoothing=0")
        errors += _rows.length_errors({"max_length": self.max_length,
                                       "max_prompt_length": self.max_prompt_length,
                                       "max_completion_length": self.max_completion_length})
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of <= 0:
            errors.append("method.pad_to_multiple_of must be a positive integer or null")
        errors += _reference.reference_errors(self, ctx)
        errors += _layout.layout_errors(self, ctx)
        errors += self.liger_errors(ctx)
        errors += _liger.preference_errors(self, ctx, "DPO")
        if self.liger_loss() and (self.loss_type != "sigmoid" or self.label_smoothing):
            errors.append("Liger's fused linear DPO loss (method.use_liger_kernel=true) "
                          "implements loss_type=sigmoid without label smoothing; set "
                          "method.loss_type=sigmoid, method.label_smoothing=0 (or drop "
                          "fused_linear_cross_entropy from method.liger_kernels)")
        return errors

    # ------------------------------------------------------------------ data
    def prepare(self, ds, tokenizer, ctx: BuildContext) -> tuple[Any, DataStats]:
        """tokenize + truncate every pair; rows: prompt_ids, chosen_ids, rejected_ids."""
        cols = set(ds.column_names)
        if not {"chosen", "rejected"} <= cols:
            raise DataError(f"method=dpo needs rows with 'prompt', 'chosen' and 'rejected' "
                            f"(preference pairs); this dataset has columns {sorted(cols)}")
        explicit = "prompt" in cols
        limits = (self.max_prompt_length, self.max_completion_length, self.max_length)
        keeps = (_rows.keeps(self.max_prompt_length, self.max_length),  # cut before tokenizing
                 _rows.keeps(self.max_completion_length, self.max_length))
        row_cap = _layout.unit_row(ctx, self.max_length)  # packing=bfd: a pair fills one row
        fit = row_cap is not None
        shared = self.share_prompt

        def fn(row: dict, idx: int) -> list[dict]:
            if explicit:
                prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
            else:
                prompt, chosen, rejected = _rows.split_implicit_prompt(row["chosen"],
                                                                       row["rejected"], idx)
            p, (c, r), n_cut = _rows.encode_example(
                tokenizer, prompt, [(chosen, "chosen"), (rejected, "rejected")], idx,
                row.get("tools"), *keeps)
            n_in = (1 if shared else 2) * len(p) + len(c) + len(r)
            cut = _rows.truncate(p, [c, r], *limits)
            if cut is not None and row_cap is not None:
                fitted = _rows.fit_row(len(cut[0]), cut[1], row_cap, shared)
                cut = None if fitted is None else (cut[0], fitted[0], 0)
            if cut is None:
                return [{"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "keep": False,
                         "n_in": n_in, "n_dropped": n_in, "n_train": 0, "n_empty": 0,
                         "n_cut": n_cut}]
            p, (c, r), _ = cut
            kept = (1 if shared else 2) * len(p) + len(c) + len(r)
            (tc, ec), (tr, er) = _rows.content_tokens(chosen, c), _rows.content_tokens(rejected, r)
            return [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r, "keep": True,
                     "n_in": n_in, "n_dropped": n_in - kept, "n_train": tc + tr,
                     "n_empty": ec + er, "n_cut": n_cut}]

        key = ("dpo", explicit, limits, fit, shared, tokenizer.name_or_path, len(tokenizer))
        out, stats = _rows.kept(_rows.map_rows(
            ds, fn, ("prompt_ids", "chosen_ids", "rejected_ids", "keep", *_rows.TALLY), key,
            "tokenize pairs"))
        stats.hollow_rows, stats.hollow_what = _rows.same_pairs(out), _rows.SAME_PAIRS
        return out, stats

    def unit_sizes(self, ds, ctx: BuildContext) -> tuple[list[int], list[list[int]]]:
        """A pair in one row (the prompt once with ``share_prompt``), and its two sequences."""
        k = 1 if self.share_prompt else 2
        whole, pieces = [], []
        for p, c, r in zip(ds["prompt_ids"], ds["chosen_ids"], ds["rejected_ids"], strict=True):
            whole.append(k * len(p) + len(c) + len(r))
            pieces.append([len(p) + len(c), len(p) + len(r)])
        return whole, pieces

    # ------------------------------------------------------------------ batches
    def _collate(self, rows: list[dict], pad_id: int, mask: bool = True) -> Batch:
        units, rows_of = _layout.units_of(rows)
        if rows_of is not None or self.share_prompt:
            return self._collate_layout(units, rows_of, pad_id)
        seqs = [_layout.sequence(r["prompt_ids"], r["chosen_ids"]) for r in rows]
        seqs += [_layout.sequence(r["prompt_ids"], r["rejected_ids"]) for r in rows]
        t, real, total = _layout.collate_sequences(seqs, pad_id, self.pad_to_multiple_of,
                                                    self.padding_free, scored=self.labelled())
        if not mask:
            t.pop("attention_mask", None)
        if "ref_chosen_logps" in rows[0]:
            t["ref_logps"] = torch.tensor([r["ref_chosen_logps"] for r in rows]
                                          + [r["ref_rejected_logps"] for r in rows],
                                          dtype=torch.float32)
        return Batch(t, num_items=len(rows), real_tokens=real, total_tokens=total,
                     size_key=batch_key(t, real, total, self.padding_free),
                     meta={"samples": len(rows)})

    def _collate_layout(self, units: list[dict], rows_of: list[list[int]] | None,
                        pad_id: int) -> Batch:
        """Packed rows (``rows_of``: the row of each pair's pieces) or, unpacked with
        ``share_prompt``, one pair per row (padded) / all pairs in one row (padding-free)."""
        b = len(units)
        rows_of = rows_of or [[i] for i in range(b)]
        docs = [_layout.unit_docs(u["prompt_ids"], [u["chosen_ids"], u["rejected_ids"]],
                                  [i, b + i], shared=self.share_prompt and len(rows_of[i]) == 1)
                for i, u in enumerate(units)]
        # real tokens: those stored (a shared prompt once; a split pair's prompt in each row)
        t, real, total = _layout.collate_rows(_layout.place(docs, rows_of), pad_id,
                                              self.pad_to_multiple_of, self.padding_free,
                                              scored=self.labelled())
        if "ref_chosen_logps" in units[0]:
            t["ref_logps"] = torch.tensor([u["ref_chosen_logps"] for u in units]
                                          + [u["ref_rejected_logps"] for u in units],
                                          dtype=torch.float32)
        return Batch(t, num_items=b, real_tokens=real, total_tokens=total,
                     size_key=batch_key(t, real, total, self.padding_free),
                     meta={"samples": b})

    # ------------------------------------------------------------------ models
    def extra_models(self, policy, ctx: BuildContext, build) -> dict[str, Any]:
        return _reference.reference_models(self, policy, ctx, build)

    def before_training(self, models, ds, ctx: BuildContext):
        """reference=precomputed: reference log-probs of every pair, as dataset columns."""
        if self.reference != "precomputed":
            return None
        pad = _layout.pad_id_of(models)

        def run(model, batch: Batch, items: list[dict]) -> dict[str, list]:
            b = batch.num_items
            logps = _layout.completion_logps(model, batch.tensors, 2 * b,
                                            attention=ctx.attention)[0].float().tolist()
            return {"ref_chosen_logps": _layout.per_item(logps[:b], items),
                    "ref_rejected_logps": _layout.per_item(logps[b:], items)}

        mask = not drops_padding_mask(self.padding_mask, ctx)
        return _reference.precompute(self, models, ds, ctx,
                                     lambda rows: self._collate(rows, pad, mask), run)

    # ------------------------------------------------------------------ loss
    def reference_logps(self, models, t: dict[str, torch.Tensor], n: int,
                        attention: Any = None) -> torch.Tensor:
        """Summed completion log-probs of the ``n`` sequences under the reference."""
        if "ref_logps" in t:
            return t["ref_logps"]
        with _reference.reference_forward(self, models) as ref:
            return _layout.completion_logps(ref, t, n, attention=attention)[0]

    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        from memlab.losses import dpo_loss

        if self.liger_loss():
            return self._liger_loss(models, batch)
        t, b = batch.tensors, batch.num_items
        # reference first: its logits are freed before the policy's graph exists (lower peak)
        attention = _layout.attention_of(ctx)
        ref = self.reference_logps(models, t, 2 * b, attention)
        logps, counts = _layout.completion_logps(models["policy"], t, 2 * b, attention=attention)
        pol_in, ref_in = logps, ref
        if self.loss_type == "ipo":  # IPO is defined on length-averaged log-probs
            n = counts.clamp(min=1).to(logps.dtype)
            pol_in, ref_in = logps / n, ref / n
        losses, rc, rr = dpo_loss(pol_in[:b], pol_in[b:], ref_in[:b], ref_in[b:], beta=self.beta,
                                  loss_type=self.loss_type, label_smoothing=self.label_smoothing)
        metrics = {
            "rewards/chosen": float(rc.mean()),
            "rewards/rejected": float(rr.mean()),
            "rewards/margins": float((rc - rr).mean()),
            "rewards/accuracies": float((rc > rr).float().mean()),
            "logps/chosen": float(logps[:b].detach().mean()),
            "logps/rejected": float(logps[b:].detach().mean()),
        }
        return losses.sum(), metrics

    def _liger_loss(self, models: dict, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Liger's fused linear DPO: chosen rows first in ``[2B, T, H]``, labels aligned; the loss
        it returns is the mean over pairs, so it is scaled back to a sum."""
        t, b = batch.tensors, batch.num_items
        hidden, head = _liger.hidden_and_head(models["policy"], t)
        with _reference.reference_forward(self, models) as ref:
            ref_hidden, ref_head = _liger.hidden_and_head(ref, t)
        fn = _liger.liger_module(self, "LigerFusedLinearDPOLoss", beta=self.beta,
                                 use_ref_model=True, compute_nll_loss=False,
                                 average_log_prob=False, loss_type="sigmoid")
        out = fn(head.weight, hidden, t["labels"], bias=getattr(head, "bias", None),
                 ref_input=ref_hidden, ref_weight=ref_head.weight,
                 ref_bias=getattr(ref_head, "bias", None))
        return _liger.liger_loss_value(out) * b, {}
