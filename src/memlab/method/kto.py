"""`method=kto`: Kahneman-Tversky Optimization on unpaired desirable / undesirable examples.

Rows: unpaired ``prompt`` + ``completion`` + ``label`` (true = desirable), or preference pairs
``prompt`` + ``chosen`` + ``rejected``, each of which becomes one desirable (prompt, chosen) and
one undesirable (prompt, rejected) example. Conversational or plain strings; tokenization and
truncation as in ``method=dpo`` (prompt cut from the left, completion from the right, prompt
alone filling ``max_length`` drops the example).

KL reference point: every example also carries a *mismatched* completion - that of the next
example in dataset order whose prompt differs - fixed at preparation (as TRL does, so the
reference side can be precomputed). Per micro-batch, ``KL = max(0, mean(policy - reference))``
over the mismatched sequences, both computed without gradient (the term is detached in KTO).

The output head runs only where a completion token is predicted (``head_on=labelled``) and
right-padded rows go without their mask under eager / sdpa (``padding_mask=auto``), as in DPO.

Reference handling is DPO's (``copy | adapter_disabled | precomputed``); precomputed stores
``ref_logps`` and ``ref_kl_logps`` columns.

Packing (``packing=bfd | bfd_split``, :mod:`memlab.packing.groups`): the unit is an example with
its KL sequence. Main and KL sequences keep their two forwards (the KL one without gradient), as
two lanes of rows: a unit's KL sequence sits in the KL row of the same index as its main
sequence, so a unit's size is the larger of its two. ``share_prompt`` (paired rows only: the two
examples of a pair share its prompt) makes the unit the pair: its prompt stored once for the
chosen and rejected examples (each seeing the prompt and itself only), and once for their two KL
sequences; ``bfd`` cuts the completions of a pair that does not fit a row to a common length
(counted), ``bfd_split`` puts its two examples in two rows of one micro-batch. ``loss()`` returns the SUM of per-example losses;
``num_items`` = examples. Metrics: kl, rewards/chosen, rewards/rejected, rewards/margins,
logps/chosen, logps/rejected (per-class means within each micro-batch, 0 when a class is
absent), desirable_fraction.
"""

from __future__ import annotations

import hashlib
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
from memlab.registry import NonNegativeFloat, PositiveFloat, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.packing.groups import GroupPacked


def mismatched_partners(prompts: list[list[int]]) -> list[int]:
    """For each example, the index of the next example (cyclically) with a different prompt;
    the next one when every prompt is the same."""
    n = len(prompts)
    out = []
    for i in range(n):
        j = (i + 1) % n
        for step in range(1, n):
            k = (i + step) % n
            if prompts[k] != prompts[i]:
                j = k
                break
        out.append(j)
    return out


@register("kto")
@dataclass(kw_only=True)
class KTO(Offline, PreferenceBatches):
    """KTO knobs, named as in TRL's KTOConfig where one exists."""

    beta: PositiveFloat = 0.1
    """KL strength of the implicit reward."""
    desirable_weight: NonNegativeFloat = 1.0
    """Loss weight of desirable examples (lambda_D)."""
    undesirable_weight: NonNegativeFloat = 1.0
    """Loss weight of undesirable examples (lambda_U)."""
    reference: Literal["copy", "adapter_disabled", "precomputed"] = "copy"
    """As in method=dpo: frozen copy, policy with its LoRA adapter off, or precomputed log-probs."""
    max_length: Annotated[int, Range(ge=2)] | None = 1024
    """Longest prompt + completion; the completion is cut to fit. None = no limit."""

    data_kinds: ClassVar[tuple[str, ...]] = ("preference",)
    head: ClassVar[Head] = "causal_lm"
    trains_extra_models: ClassVar[bool] = False
    items_name: ClassVar[str] = "examples"
    eval_metrics: ClassVar[tuple[str, ...]] = (
        "loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
        "logps/rejected")

    # ------------------------------------------------------------------ capabilities
    def as_extra_models(self) -> ExtraModels | None:
        return self

    def as_group_packed(self) -> GroupPacked | None:
        return self

    def as_liger(self) -> LigerUser | None:
        return self

    def unit_pieces(self) -> int:
        return 2 if self.share_prompt else 1

    # ------------------------------------------------------------------ validation
    def validate(self, ctx: BuildContext) -> list[str]:
        errors = []
        if self.beta <= 0:
            errors.append(f"method.beta must be > 0 (got {self.beta})")
        for name, weight in (("desirable_weight", self.desirable_weight),
                             ("undesirable_weight", self.undesirable_weight)):
            if weight < 0:
                errors.append(f"method.{name} must be >= 0 (got {weight})")
        errors += _rows.length_errors({"max_length": self.max_length,
                                       "max_prompt_length": self.max_prompt_length,
                                       "max_completion_length": self.max_completion_length})
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of <= 0:
            errors.append("method.pad_to_multiple_of must be a positive integer or null")
        errors += _reference.reference_errors(self, ctx)
        errors += _layout.layout_errors(self, ctx)
        errors += self.liger_errors(ctx)
        errors += _liger.preference_errors(self, ctx, "KTO")
        if self.liger_loss() and (self.desirable_weight != 1 or self.undesirable_weight != 1):
            errors.append("Liger's fused linear KTO loss (method.use_liger_kernel=true) has no "
                          "class weights; set method.desirable_weight=1 and "
                          "method.undesirable_weight=1 (or drop fused_linear_cross_entropy from "
                          "method.liger_kernels)")
        return errors

    # ------------------------------------------------------------------ data
    def prepare(self, ds, tokenizer, ctx: BuildContext) -> tuple[Any, DataStats]:
        """Rows: prompt_ids, completion_ids, kl_completion_ids, label."""
        cols = set(ds.column_names)
        if {"completion", "label"} <= cols and "prompt" in cols:
            paired = False
        elif {"chosen", "rejected"} <= cols:
            paired = True
        else:
            raise DataError(
                "method=kto needs unpaired rows ('prompt', 'completion', 'label') or preference "
                f"pairs ('prompt', 'chosen', 'rejected'); this dataset has columns {sorted(cols)}"
            )
        explicit = "prompt" in cols
        limits = (self.max_prompt_length, self.max_completion_length, self.max_length)
        keeps = (_rows.keeps(self.max_prompt_length, self.max_length),  # cut before tokenizing
                 _rows.keeps(self.max_completion_length, self.max_length))
        if self.share_prompt:
            if not paired:
                raise DataError("method.share_prompt=true stores a pair's prompt once for its two "
                                "examples; this dataset is unpaired ('prompt', 'completion', "
                                "'label'): set method.share_prompt=false")
            return self._prepare_pairs(ds, tokenizer, ctx, explicit, limits, keeps)

        def fn(row: dict, idx: int) -> list[dict]:
            if paired:
                if explicit:
                    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
                else:
                    prompt, chosen, rejected = _rows.split_implicit_prompt(row["chosen"],
                                                                       row["rejected"], idx)
                items = [(chosen, True, "chosen"), (rejected, False, "rejected")]
            else:
                prompt, label = row["prompt"], row["label"]
                if not isinstance(label, (bool, int)) or label not in (0, 1):
                    raise DataError(f"row {idx}: field 'label' must be true/false (desirable or "
                                    f"not), got {label!r}")
                items = [(row["completion"], bool(label), "completion")]
            p, cs, n_cut = _rows.encode_example(tokenizer, prompt, [(c, f) for c, _, f in items],
                                                idx, row.get("tools"), *keeps)
            out = []
            for (completion, label, _), c in zip(items, cs, strict=True):
                n_in = len(p) + len(c)
                cut = _rows.truncate(p, [c], *limits)
                if cut is None:
                    out.append({"prompt_ids": [], "completion_ids": [], "label": label,
                                "keep": False, "n_in": n_in, "n_dropped": n_in, "n_train": 0,
                                "n_empty": 0, "n_cut": n_cut})
                else:
                    pp, (cc,), dropped = cut
                    n_train, n_empty = _rows.content_tokens(completion, cc)
                    out.append({"prompt_ids": pp, "completion_ids": cc, "label": label,
                                "keep": True, "n_in": n_in, "n_dropped": dropped,
                                "n_train": n_train, "n_empty": n_empty, "n_cut": n_cut})
                n_cut = 0  # (a pair's characters cut counted once)
            return out

        key = ("kto", paired, explicit, limits, tokenizer.name_or_path, len(tokenizer))
        out, stats = _rows.kept(_rows.map_rows(
            ds, fn, ("prompt_ids", "completion_ids", "label", "keep", *_rows.TALLY), key,
            "tokenize examples"))
        prompts, completions = out["prompt_ids"], out["completion_ids"]
        kl = []
        for i, j in enumerate(mismatched_partners(prompts)):
            room = None if self.max_length is None else self.max_length - len(prompts[i])
            kl.append(completions[j][:room])
        fp = hashlib.sha1(repr((out._fingerprint, "kl")).encode()).hexdigest()
        out = out.add_column("kl_completion_ids", kl, new_fingerprint=fp)
        labels = out["label"]
        return out, self._stats(stats, desirable=int(sum(labels)),
                                undesirable=int(len(labels) - sum(labels)))

    @staticmethod
    def _stats(stats: DataStats, desirable: int, undesirable: int, per_row: int = 1
               ) -> DataStats:
        """``stats`` (:func:`memlab.method._rows.kept`) with KTO's counts: an empty completion
        is a hollow example; ``per_row`` examples a row (a pair's two with share_prompt)."""
        empty = stats.extra["empty_completions"]
        stats.examples *= per_row
        stats.examples_dropped *= per_row
        stats.hollow_rows, stats.hollow_what = empty, _rows.EMPTY_COMPLETIONS
        cut = {k: v for k, v in stats.extra.items() if k == "cut_before_tokenizing"}
        stats.extra = {"desirable": desirable, "undesirable": undesirable,
                       "empty_completions": empty, **cut}
        return stats

    def _prepare_pairs(self, ds, tokenizer, ctx: BuildContext, explicit: bool, limits: tuple,
                       keeps: tuple) -> tuple[Any, DataStats]:
        """``share_prompt``: one row per pair, its two examples in lists: prompt_ids,
        completion_ids [chosen, rejected], label [true, false], kl_completion_ids."""
        row_cap = _layout.unit_row(ctx, self.max_length)  # packing=bfd: a pair fills one row
        fit = row_cap is not None

        def fn(row: dict, idx: int) -> list[dict]:
            if explicit:
                prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
            else:
                prompt, chosen, rejected = _rows.split_implicit_prompt(row["chosen"],
                                                                       row["rejected"], idx)
            p, (c, r), n_cut = _rows.encode_example(
                tokenizer, prompt, [(chosen, "chosen"), (rejected, "rejected")], idx,
                row.get("tools"), *keeps)
            n_in = len(p) + len(c) + len(r)
            cut = _rows.truncate(p, [c, r], *limits)
            if cut is not None and row_cap is not None:
                fitted = _rows.fit_row(len(cut[0]), cut[1], row_cap, True)
                cut = None if fitted is None else (cut[0], fitted[0], 0)
            if cut is None:
                return [{"prompt_ids": [], "completion_ids": [[], []], "label": [True, False],
                         "keep": False, "n_in": n_in, "n_dropped": n_in, "n_train": 0,
                         "n_empty": 0, "n_cut": n_cut}]
            p, cr, _ = cut
            (tc, ec), (tr, er) = (_rows.content_tokens(x, ids)
                                  for x, ids in zip((chosen, rejected), cr, strict=True))
            return [{"prompt_ids": p, "completion_ids": cr, "label": [True, False],
                     "keep": True, "n_in": n_in, "n_dropped": n_in - len(p) - sum(map(len, cr)),
                     "n_train": tc + tr, "n_empty": ec + er, "n_cut": n_cut}]

        key = ("kto-pairs", explicit, limits, fit, tokenizer.name_or_path, len(tokenizer))
        out, stats = _rows.kept(_rows.map_rows(
            ds, fn, ("prompt_ids", "completion_ids", "label", "keep", *_rows.TALLY), key,
            "tokenize pairs"))
        prompts = [p for p in out["prompt_ids"] for _ in range(2)]
        completions = [c for cr in out["completion_ids"] for c in cr]
        kl: list[list[list[int]]] = []
        partners = mismatched_partners(prompts)
        for pair, p in enumerate(out["prompt_ids"]):
            room = None if self.max_length is None else self.max_length - len(p)
            pair_kl = [completions[partners[2 * pair + i]][:room] for i in range(2)]
            if row_cap is not None:  # the KL lane's row holds the pair's two KL sequences, the
                # prompt once (its pair fitted that row, so the prompt leaves room for them)
                fitted_kl = _rows.fit_row(len(p), pair_kl, row_cap, True)
                if fitted_kl is None:
                    raise ValueError(f"pair {pair}: the KL sequences do not fit a row of {row_cap} "
                                     "tokens beside the prompt")
                pair_kl = fitted_kl[0]
            kl.append(pair_kl)
        fp = hashlib.sha1(repr((out._fingerprint, "kl")).encode()).hexdigest()
        out = out.add_column("kl_completion_ids", kl, new_fingerprint=fp)
        return out, self._stats(stats, desirable=len(out), undesirable=len(out), per_row=2)

    def unit_sizes(self, ds, ctx: BuildContext) -> tuple[list[int], list[list[int]]]:
        """A unit's tokens in the larger of its main and KL rows: an example (its sequence,
        its KL sequence), or with ``share_prompt`` a pair (the prompt once per row)."""
        whole, pieces = [], []
        for p, c, k in zip(ds["prompt_ids"], ds["completion_ids"], ds["kl_completion_ids"],
                           strict=True):
            if not self.share_prompt:
                size = len(p) + max(len(c), len(k))
                whole.append(size)
                pieces.append([size])
                continue
            whole.append(len(p) + max(sum(map(len, c)), sum(map(len, k))))
            pieces.append([len(p) + max(len(ci), len(ki)) for ci, ki in zip(c, k, strict=True)])
        return whole, pieces

    # ------------------------------------------------------------------ batches
    def _collate(self, rows: list[dict], pad_id: int, mask: bool = True) -> Batch:
        units, rows_of = _layout.units_of(rows)
        if rows_of is not None or self.share_prompt:
            return self._collate_layout(units, rows_of, pad_id)
        main = [_layout.sequence(r["prompt_ids"], r["completion_ids"]) for r in rows]
        kl = [_layout.sequence(r["prompt_ids"], r["kl_completion_ids"]) for r in rows]
        multiple, flat, scored = self.pad_to_multiple_of, self.padding_free, self.labelled()
        t, real, total = _layout.collate_sequences(main, pad_id, multiple, flat, scored)
        tk, real_kl, total_kl = _layout.collate_sequences(kl, pad_id, multiple, flat, scored)
        if not mask:
            t.pop("attention_mask", None)
            tk.pop("attention_mask", None)
        t.update({f"kl_{k}": v for k, v in tk.items()})
        t["label"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
        if "ref_logps" in rows[0]:
            t["ref_logps"] = torch.tensor([r["ref_logps"] for r in rows], dtype=torch.float32)
            t["ref_kl_logps"] = torch.tensor([r["ref_kl_logps"] for r in rows],
                                             dtype=torch.float32)
        key = batch_key(t, real, total + total_kl, self.padding_free)
        # real_tokens counts the trained sequences; the KL forward is auxiliary work
        return Batch(t, num_items=len(rows), real_tokens=real, total_tokens=total, size_key=key,
                     meta={"samples": len(rows), "kl_tokens": real_kl})

    def _examples(self, unit: dict, name: str) -> list:
        """A unit's per-example values of column ``name`` (a pair's two with share_prompt)."""
        return list(unit[name]) if self.share_prompt else [unit[name]]

    def _collate_layout(self, units: list[dict], rows_of: list[list[int]] | None,
                        pad_id: int) -> Batch:
        """Packed rows (``rows_of``: the row of each unit's pieces) or, unpacked with
        ``share_prompt``, one pair per row (padded) / every pair in one row (padding-free);
        the KL sequences in the same layout, as their own tensors (``kl_*``)."""
        rows_of = rows_of or [[i] for i in range(len(units))]
        main, kl, n = [], [], 0
        for u, rows in zip(units, rows_of, strict=True):
            comps = self._examples(u, "completion_ids")
            seqs = list(range(n, n + len(comps)))
            n += len(comps)
            shared = self.share_prompt and len(rows) == 1
            main.append(_layout.unit_docs(u["prompt_ids"], comps, seqs, shared))
            kl.append(_layout.unit_docs(u["prompt_ids"], self._examples(u, "kl_completion_ids"),
                                        seqs, shared))
        multiple, flat = self.pad_to_multiple_of, self.padding_free
        t, real, total = _layout.collate_rows(_layout.place(main, rows_of), pad_id, multiple,
                                              flat, scored=self.labelled())
        tk, real_kl, total_kl = _layout.collate_rows(_layout.place(kl, rows_of), pad_id,
                                                     multiple, flat, scored=self.labelled())
        t.update({f"kl_{k}": v for k, v in tk.items()})
        t["label"] = torch.tensor([bool(x) for u in units for x in self._examples(u, "label")],
                                  dtype=torch.bool)
        if "ref_logps" in units[0]:
            for name in ("ref_logps", "ref_kl_logps"):
                t[name] = torch.tensor([x for u in units for x in self._examples(u, name)],
                                       dtype=torch.float32)
        return Batch(t, num_items=n, real_tokens=real, total_tokens=total,
                     size_key=batch_key(t, real, total + total_kl, flat),
                     meta={"samples": n, "kl_tokens": real_kl})

    # ------------------------------------------------------------------ models
    def extra_models(self, policy, ctx: BuildContext, build) -> dict[str, Any]:
        return _reference.reference_models(self, policy, ctx, build)

    def before_training(self, models, ds, ctx: BuildContext):
        """reference=precomputed: reference log-probs of each example and of its mismatched
        (KL) sequence, as dataset columns."""
        if self.reference != "precomputed":
            return None
        pad = _layout.pad_id_of(models)

        def run(model, batch: Batch, items: list[dict]) -> dict[str, list]:
            n, t = batch.num_items, batch.tensors
            out = {}
            for name, prefix in (("ref_logps", ""), ("ref_kl_logps", "kl_")):
                values = _layout.completion_logps(model, t, n, prefix,
                                                 attention=ctx.attention)[0].float().tolist()
                if self.share_prompt:  # per unit: the pair's two examples
                    values = [values[i: i + 2] for i in range(0, n, 2)]
                out[name] = _layout.per_item(values, items)
            return out

        mask = not drops_padding_mask(self.padding_mask, ctx)
        return _reference.precompute(self, models, ds, ctx,
                                     lambda rows: self._collate(rows, pad, mask), run)

    # ------------------------------------------------------------------ loss
    def reference_logps(self, models, t: dict[str, torch.Tensor], n: int, attention: Any = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference log-probs of the examples and of their mismatched sequences."""
        if "ref_logps" in t:
            return t["ref_logps"], t["ref_kl_logps"]
        with _reference.reference_forward(self, models) as ref:
            return (_layout.completion_logps(ref, t, n, attention=attention)[0],
                    _layout.completion_logps(ref, t, n, "kl_", attention=attention)[0])

    def kl_estimate(self, models, t: dict[str, torch.Tensor], n: int,
                    ref_kl: torch.Tensor, attention: Any = None) -> torch.Tensor:
        """Detached ``max(0, mean(policy - reference))`` on the mismatched sequences."""
        from memlab.losses import kto_kl_estimate

        with torch.no_grad():
            policy_kl = _layout.completion_logps(models["policy"], t, n, "kl_",
                                                attention=attention)[0]
        return kto_kl_estimate(policy_kl, ref_kl)

    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        from memlab.losses import kto_loss

        t, n = batch.tensors, batch.num_items
        if self.liger_loss():
            return self._liger_loss(models, batch)
        attention = _layout.attention_of(ctx)
        ref, ref_kl = self.reference_logps(models, t, n, attention)
        kl = self.kl_estimate(models, t, n, ref_kl, attention)
        logps, _ = _layout.completion_logps(models["policy"], t, n, attention=attention)
        desirable = t["label"]
        losses, rewards = kto_loss(logps, ref, desirable, kl, beta=self.beta,
                                   desirable_weight=self.desirable_weight,
                                   undesirable_weight=self.undesirable_weight)
        lp = logps.detach()

        def mean(x: torch.Tensor, mask: torch.Tensor) -> float:
            return float(x[mask].mean()) if bool(mask.any()) else 0.0

        und = ~desirable
        metrics = {
            "kl": float(kl),
            "rewards/chosen": mean(rewards, desirable),
            "rewards/rejected": mean(rewards, und),
            "rewards/margins": mean(rewards, desirable) - mean(rewards, und),
            "logps/chosen": mean(lp, desirable),
            "logps/rejected": mean(lp, und),
            "desirable_fraction": float(desirable.float().mean()),
        }
        return losses.sum(), metrics

    def _liger_loss(self, models: dict, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Liger's fused linear KTO on ``[B, T, H]`` hidden states (the reference's log-probs of
        the examples are computed inside it from the reference's hidden states); its loss is the
        mean over examples, scaled back to a sum."""
        t, n = batch.tensors, batch.num_items
        with _reference.reference_forward(self, models) as ref:
            ref_kl = _layout.completion_logps(ref, t, n, "kl_")[0]
            ref_hidden, ref_head = _liger.hidden_and_head(ref, t)
        kl = self.kl_estimate(models, t, n, ref_kl)
        hidden, head = _liger.hidden_and_head(models["policy"], t)
        fn = _liger.liger_module(self, "LigerFusedLinearKTOLoss", beta=self.beta,
                                 use_ref_model=True, average_log_prob=False)
        out = fn(hidden, head.weight, t["labels"], bias=getattr(head, "bias", None),
                 preference_labels=t["label"], ref_input=ref_hidden, ref_weight=ref_head.weight,
                 ref_bias=getattr(ref_head, "bias", None), kl=kl)
        return _liger.liger_loss_value(out) * n, {"kl": float(kl)}
