"""`method=gkd`: Generalized Knowledge Distillation (Agarwal et al. 2024, as TRL's GKDTrainer):
the student (the policy) matches a frozen teacher's next-token distributions on the completion
tokens of conversations, with the generalized Jensen-Shannon divergence

    JSD_beta(P_teacher || P_student) = beta * KL(P_teacher || M) + (1 - beta) * KL(P_student || M),
    M = beta * P_teacher + (1 - beta) * P_student

(``beta=0`` is the forward KL(teacher || student), ``beta=1`` the reverse KL(student ||
teacher), both at ``temperature``). With probability ``lmbda`` a micro-batch's completions are
replaced by the student's own samples (on-policy distillation, in the measured ``generate``
phase); otherwise, with ``seq_kd``, by the teacher's samples; otherwise the dataset's answers
are used.

The teacher is the run's model group with ``teacher`` overrides applied, e.g.
``method.teacher={name_or_path: Qwen/Qwen2.5-7B-Instruct}`` for ``model=hf`` or
``method.teacher={hidden_size: 256, num_layers: 8, seed: 1}`` for ``model=tiny``; it must share
the student's tokenizer. Both models' full ``[tokens, vocab]`` fp32 log-probabilities exist
during the loss: that is the memory cost this method adds over SFT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch
import torch.nn.functional as F

from memlab.data.base import DataError
from memlab.generation.base import GenerationEnv, SamplingParams
from memlab.method import _overrides, _reference, _rows
from memlab.method._knobs import PromptLength
from memlab.method._rollout import join, prompt_and_reference
from memlab.method.base import (
    IGNORE,
    Batch,
    DataStats,
    ExtraModels,
    Generating,
    NoCapabilities,
    RowLayout,
    loss_sums,
    model_inputs,
    register,
)
from memlab.model.base import Head
from memlab.registry import Fraction, PositiveFloat, PositiveInt, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext


@register("gkd")
@dataclass(kw_only=True)
class GKD(PromptLength, NoCapabilities):
    """GKD knobs, named as in TRL's GKDConfig."""

    teacher: dict[str, Any] | None = None
    """Model-group overrides that make the teacher (None = a second copy of the student's
    initial model, useful only as a control: the loss is then 0 at the start)."""
    lmbda: Fraction = 0.5
    """Share of micro-batches trained on the student's own samples (on-policy)."""
    beta: Fraction = 0.5
    """JSD interpolation: 0 = forward KL(teacher||student), 1 = reverse KL(student||teacher)."""
    temperature: PositiveFloat = 0.9
    """Softmax temperature of both distributions, and of sampling."""
    max_new_tokens: PositiveInt = 128
    """Length of sampled completions (on-policy / seq_kd)."""
    seq_kd: bool = False
    """Off-policy micro-batches use the teacher's samples instead of the dataset's answers."""
    max_length: Annotated[int, Range(ge=2)] | None = 1024
    """Longest prompt + completion; the completion is cut to fit. None = no limit."""

    data_kinds: ClassVar[tuple[str, ...]] = ("chat",)
    head: ClassVar[Head] = "causal_lm"
    trains_extra_models: ClassVar[bool] = False
    supports_sampling_correction: ClassVar[bool] = False
    items_name: ClassVar[str] = "completion tokens"
    eval_metrics: ClassVar[tuple[str, ...]] = ("loss",)
    """The generalized JSD on the held-out conversations' own answers."""
    num_iterations: ClassVar[int] = 1
    """One optimizer step per generated batch."""

    # ------------------------------------------------------------------ capabilities
    def as_generating(self) -> Generating | None:
        """Samples in the generate phase when some micro-batches are on-policy or the
        teacher's (``lmbda > 0`` or ``seq_kd``)."""
        return self if self.lmbda > 0 or self.seq_kd else None

    def as_extra_models(self) -> ExtraModels | None:
        return self

    def row_layout(self, ctx: BuildContext) -> RowLayout:
        online = self.as_generating() is not None
        return RowLayout(supports_packing=False, supports_padding_free=False, packs_rows=False,
                         row_length=self.max_prompt_length if online else self.max_length,
                         pad_to_multiple_of=None, keeps_row_end=False)

    def sampling_length(self) -> int:
        return self.max_new_tokens

    def rows_per_prompt(self) -> int:
        return 1

    def worst_case_tensors(self, batch: Batch, new_tokens: int, token: int, ctx
                           ) -> dict[str, torch.Tensor]:
        """The sampled batch where every completion runs to ``new_tokens`` tokens."""
        t = batch.tensors
        comp = torch.full((t["prompt_ids"].shape[0], new_tokens), token, dtype=torch.long)
        return join(t["prompt_ids"], t["prompt_mask"], comp, torch.ones_like(comp))

    # ------------------------------------------------------------------ validation
    def validate(self, ctx: BuildContext) -> list[str]:
        errors = _rows.length_errors({"max_length": self.max_length,
                                      "max_prompt_length": self.max_prompt_length,
                                      "max_new_tokens": self.max_new_tokens})
        if not 0 <= self.lmbda <= 1:
            errors.append(f"method.lmbda must be in [0, 1] (got {self.lmbda})")
        if not 0 <= self.beta <= 1:
            errors.append(f"method.beta must be in [0, 1] (got {self.beta})")
        if self.temperature <= 0:
            errors.append(f"method.temperature must be > 0 (got {self.temperature})")
        teacher_cfg = self.teacher or {}
        errors += _overrides.override_key_errors(ctx, teacher_cfg, "method.teacher")
        if "vocab_size" in teacher_cfg or "tokenizer" in teacher_cfg:
            errors.append("method.teacher must share the student's tokenizer and vocabulary; "
                          "drop vocab_size / tokenizer from method.teacher")
        if not errors and teacher_cfg:
            errors += _overrides.overridden_model_errors(ctx, teacher_cfg, "method.teacher")
        return errors

    # ------------------------------------------------------------------ data
    def prepare(self, ds, tokenizer, ctx: BuildContext) -> tuple[Any, DataStats]:
        """Prompt (conversation up to its last user turn, chat template with the generation
        prompt) and completion (the following assistant turn) tokens, truncated like DPO's."""
        if "messages" not in ds.column_names:
            raise DataError(f"method=gkd needs conversations ('messages'); this dataset has "
                            f"columns {sorted(ds.column_names)}")
        stats = {"n_in": 0, "dropped": 0, "examples_dropped": 0}

        def fn(row: dict, idx: int) -> list[dict]:
            prompt, answer = prompt_and_reference(row, idx)
            # a field far longer than the limits keep is cut before tokenizing (same kept ids)
            p, (c,), n_cut = _rows.encode_example(
                tokenizer, prompt, [([{"role": "assistant", "content": answer}], "messages")],
                idx, row.get("tools"), _rows.keeps(self.max_prompt_length, self.max_length),
                self.max_length)
            cut = _rows.truncate(p, [c], self.max_prompt_length, None, self.max_length)
            if cut is None:
                return [{"prompt_ids": [], "completion_ids": [], "keep": False,
                         "n_in": len(p) + len(c), "dropped": len(p) + len(c), "n_cut": n_cut}]
            p2, (c2,), dropped = cut
            return [{"prompt_ids": p2, "completion_ids": c2, "keep": bool(c2),
                     "n_in": len(p) + len(c), "dropped": dropped, "n_cut": n_cut}]

        key = ("gkd", self.max_prompt_length, self.max_length, tokenizer.name_or_path,
               len(tokenizer))
        out = _rows.map_rows(ds, fn, ["prompt_ids", "completion_ids", "keep", "n_in", "dropped",
                                      "n_cut"], key, "tokenize conversations")
        stats["n_in"] = sum(out["n_in"])
        stats["dropped"] = sum(out["dropped"])
        n_before, extra = len(out), _rows.cut_extra(out["n_cut"])
        out = _rows.keep_rows(out, "keep", drop=["n_in", "dropped", "n_cut"])
        return out, DataStats(examples=len(ds), rows=len(out), tokens_in=stats["n_in"],
                              tokens_dropped=stats["dropped"],
                              examples_dropped=n_before - len(out), extra=extra)

    def collate(self, rows: list[dict], tokenizer, ctx: BuildContext) -> Batch:
        """The dataset's prompt + completion (left-padded prompts, right-padded completions, as
        generated batches are laid out), plus the prompts alone for sampling."""
        pad = tokenizer.pad_token_id
        pw = max(len(r["prompt_ids"]) for r in rows)
        cw = max(len(r["completion_ids"]) for r in rows)
        prompt = torch.full((len(rows), pw), pad, dtype=torch.long)
        pmask = torch.zeros_like(prompt)
        comp = torch.full((len(rows), cw), pad, dtype=torch.long)
        cmask = torch.zeros_like(comp)
        for i, r in enumerate(rows):
            n, m = len(r["prompt_ids"]), len(r["completion_ids"])
            prompt[i, pw - n:] = torch.tensor(r["prompt_ids"])
            pmask[i, pw - n:] = 1
            comp[i, :m] = torch.tensor(r["completion_ids"])
            cmask[i, :m] = 1
        t = join(prompt, pmask, comp, cmask)
        t.update(prompt_ids=prompt, prompt_mask=pmask)
        return Batch(t, num_items=int((t["labels"] != IGNORE).sum()),
                     real_tokens=int(t["attention_mask"].sum()),
                     total_tokens=t["input_ids"].numel(),
                     size_key=tuple(t["input_ids"].shape),
                     meta={"samples": len(rows), "eos": tokenizer.eos_token_id, "pad": pad,
                           "source": "dataset", "completion_width": cw,
                           "prompt_tokens": int(pmask.sum())})

    # ------------------------------------------------------------------ models
    def extra_models(self, policy, ctx: BuildContext, build) -> dict[str, Any]:
        return {"teacher": build(self.teacher or None)}

    def before_training(self, models, ds, ctx: BuildContext):
        return None

    def evaluate(self, models: dict, batch: Batch, ctx: BuildContext, env: GenerationEnv | None
                 ) -> tuple[dict[str, float], int]:
        """The loss on the held-out conversations' own answers (no sampling)."""
        return loss_sums(self, models, batch, ctx)

    def rollout(self, models: dict, batch: Batch, ctx: BuildContext, env: GenerationEnv) -> Batch:
        """On-policy (probability lmbda, the run's random draw): the student's samples; else
        with seq_kd the teacher's; else the dataset's completion."""
        u = env.rng.random()
        if u < self.lmbda:
            who = "student"
        elif self.seq_kd:
            who = "teacher"
        else:
            return batch
        t = batch.tensors
        # the student samples through the run's engine; the teacher with its own generate
        model, engine = ((models["policy"], env.engine) if who == "student"
                         else (models["teacher"], env.local))
        params = SamplingParams(max_new_tokens=self.max_new_tokens,
                                temperature=self.temperature, eos=batch.meta["eos"],
                                pad=batch.meta["pad"])
        samples = engine.generate(model, t["prompt_ids"], t["prompt_mask"], params)
        new = join(t["prompt_ids"], t["prompt_mask"], samples.completion, samples.mask)
        prompt_tokens = batch.meta["prompt_tokens"]
        return Batch(new, num_items=sum(samples.lengths),
                     real_tokens=prompt_tokens + sum(samples.lengths),
                     total_tokens=new["input_ids"].numel(),
                     size_key=tuple(new["input_ids"].shape),
                     meta={**batch.meta, "source": who,
                           "completion_width": samples.completion.shape[1]})

    # ------------------------------------------------------------------ loss
    def loss(self, models: dict, batch: Batch, ctx: BuildContext
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """Logits only for the completion block (the last ``completion_width + 1`` positions,
        ``logits_to_keep``): the prompt positions never get a [tokens, vocab] row."""
        t = batch.tensors
        inputs = model_inputs(t)
        cw = batch.meta["completion_width"]
        mask = t["labels"][:, -cw - 1:-1] != IGNORE
        student = models["policy"](**inputs, use_cache=False,
                                   logits_to_keep=cw + 1).logits[:, :-1][mask]
        with _reference.frozen_forward(models["teacher"]) as teacher_model:
            teacher = teacher_model(**inputs, use_cache=False,
                                    logits_to_keep=cw + 1).logits[:, :-1][mask]
        loss_sum = generalized_jsd(student, teacher, self.beta, self.temperature).sum()
        return loss_sum, {"on_policy": 1.0 if batch.meta.get("source") == "student" else 0.0}


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-token generalized JSD (module docstring) between ``[N, V]`` logits, in fp32.
    ``beta=0``: KL(teacher || student); ``beta=1``: KL(student || teacher)."""
    s = F.log_softmax(student_logits.float() / temperature, -1)
    t = F.log_softmax(teacher_logits.float() / temperature, -1)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), 0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s
