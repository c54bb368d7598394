"""What the online methods (``grpo``, ``rloo``, ``online_dpo``, ``ppo``) share: prompts from
conversations or preference rows, sampling ``num_generations`` completions per prompt with the
run's generation engine (``generation=``), scoring them with reward functions and reward models,
and building the training batch.

Not an option of its own (the registry skips modules whose name starts with ``_``). A method
subclasses :class:`Online` and supplies ``advantages_for`` (rewards -> one advantage per
completion), ``num_items`` (the loss normaliser of a rollout) and ``loss``.

Generation runs in the trainer's ``generate`` phase (measured like forward and backward)
through the engine the run's ``generation`` option built (``memlab.generation``: transformers'
``generate`` on the policy by default, inside its distributed wrapper). The engine returns host
copies of the completions' tokens, so scoring and counting read no device tensor.
``train.batch_size`` counts prompts (each becomes ``num_generations`` sequences). Every method
here takes one optimisation pass per generation batch (on-policy: the probability ratio is 1 in
value and carries the policy gradient).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import torch
from torch import nn

from memlab.data.base import DataError, check_messages, check_text
from memlab.generation.base import Engine, GenerationEnv, Samples, SamplingParams
from memlab.losses import token_logps
from memlab.method import _overrides, _reference, _rewards, _rows
from memlab.method.base import (
    IGNORE,
    Batch,
    DataStats,
    Generating,
    ModelFactory,
    model_inputs,
)
from memlab.model.base import Head
from memlab.registry import NonNegativeFloat, Option, PositiveFloat, PositiveInt, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.packing.groups import GroupPacked


@dataclass(kw_only=True)
class Online(Option):
    """Knobs every online method has, named as in TRL's GRPOConfig / RLOOConfig."""

    num_generations: PositiveInt = 4
    """Completions sampled per prompt (the group whose mean reward is the baseline)."""
    max_prompt_length: PositiveInt | None = 256
    """Prompt tokens kept, cut from the left. None = no limit."""
    max_completion_length: PositiveInt = 64
    temperature: PositiveFloat = 1.0
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    top_k: PositiveInt | None = None
    rewards: list[str] = field(default_factory=lambda: ["length"])
    """Built-in reward names (length, finished, reference_f1) or 'package.module:function'."""
    reward_models: list[dict[str, Any]] = field(default_factory=list)
    """Reward *models*: each entry is model-group overrides (like GKD's teacher), loaded with a
    one-output sequence-classification head, frozen, e.g. ``{name_or_path: Skywork/...}`` for
    model=hf (its own tokenizer) or ``{hidden_size: 64, seed: 3}`` for model=tiny. A model
    scores the prompt text + the completion text (its tokenizer, no extra special tokens), in
    the generate phase; each is one more model in memory."""
    reward_weights: list[Annotated[float, Range()]] | None = None
    """One weight per reward function, then one per reward model (default 1 each)."""
    target_length: PositiveInt = 24
    """Completion length (tokens) the built-in 'length' reward peaks at."""
    beta: NonNegativeFloat = 0.0
    """KL strength to the reference; 0 loads no reference model."""
    reference: Literal["copy", "adapter_disabled"] = "copy"
    """With beta > 0: a frozen copy, or the LoRA policy with its adapter off."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length without EOS out of the loss."""
    num_iterations: PositiveInt = 1
    """Optimizer steps per generation batch (TRL's num_iterations, PPO's num_ppo_epochs): the
    step's rollouts are generated once and trained on this many times; from the second
    step on the policy has moved, so the probability ratio to the log-probs recorded at
    generation time differs from 1 and the clip acts. Those log-probs cost one more no-grad
    forward in the generate phase."""

    data_kinds: ClassVar[tuple[str, ...]] = ("chat", "preference")
    head: ClassVar[Head] = "causal_lm"
    supports_packing: ClassVar[bool] = False
    supports_padding_free: ClassVar[bool] = False
    trains_extra_models: ClassVar[bool] = False
    supports_sampling_correction: ClassVar[bool] = False
    items_name: ClassVar[str] = "completion tokens"
    eval_metrics: ClassVar[tuple[str, ...]] = ("reward", "completions/mean_length",
                                               "completions/finished")
    """Of greedy completions, one per held-out prompt (:meth:`evaluate`)."""
    min_generations: ClassVar[int] = 2
    reuses_rollouts: ClassVar[bool] = True
    """Whether the loss has a probability ratio to old log-probs (num_iterations > 1 allowed)."""

    # ------------------------------------------------------------------ validation
    def validate(self, ctx: BuildContext) -> list[str]:
        errors = _rows.length_errors({"max_prompt_length": self.max_prompt_length,
                                      "max_completion_length": self.max_completion_length})
        if self.num_generations < self.min_generations:
            errors.append(f"method.num_generations must be >= {self.min_generations}: the "
                          f"advantage compares completions of the same prompt (got "
                          f"{self.num_generations})")
        if self.temperature <= 0:
            errors.append("method.temperature must be > 0 (GRPO samples its completions)")
        if not 0 < self.top_p <= 1:
            errors.append(f"method.top_p must be in (0, 1] (got {self.top_p})")
        if self.beta < 0:
            errors.append(f"method.beta must be >= 0 (got {self.beta})")
        if not self.rewards and not self.reward_models:
            errors.append("method.rewards and method.reward_models are empty; e.g. "
                          "method.rewards=[length]")
        for name in self.rewards:
            try:
                _rewards.resolve(name, self)
            except ValueError as e:
                errors.append(str(e))
        errors += self._reward_model_errors(ctx)
        n_rewards = len(self.rewards) + len(self.reward_models)
        if self.reward_weights is not None and len(self.reward_weights) != n_rewards:
            errors.append(f"method.reward_weights has {len(self.reward_weights)} values for "
                          f"{n_rewards} rewards (functions, then models); give one weight per "
                          "reward or null")
        if self.target_length < 1:
            errors.append("method.target_length must be >= 1")
        if self.num_iterations < 1:
            errors.append(f"method.num_iterations must be >= 1 (got {self.num_iterations})")
        elif self.num_iterations > 1 and not self.reuses_rollouts:
            errors.append(f"method.num_iterations={self.num_iterations}: method={self.name} has "
                          "no probability ratio to reuse its rollouts with; keep 1")
        elif self.num_iterations > 1 and ctx.train.save_every % self.num_iterations:
            errors.append(f"train.save_every={ctx.train.save_every} must be a multiple of "
                          f"method.num_iterations={self.num_iterations} (checkpoints are taken "
                          "between generation batches)")
        elif (self.num_iterations > 1 and ctx.train.save_best
              and ctx.train.eval_every % self.num_iterations):
            errors.append(f"train.save_best=true saves at evaluations, and train.eval_every="
                          f"{ctx.train.eval_every} is not a multiple of method.num_iterations="
                          f"{self.num_iterations} (checkpoints are taken between generation "
                          "batches)")
        if self.beta > 0:
            errors += _reference.reference_errors(self, ctx)
        return errors

    def _reward_model_errors(self, ctx: BuildContext) -> list[str]:
        errors: list[str] = []
        for i, entry in enumerate(self.reward_models):
            where = f"method.reward_models[{i}]"
            if not isinstance(entry, dict):
                errors.append(f"{where} must be a mapping of model-group overrides, e.g. "
                              f"{{name_or_path: my/reward-model}} (got {entry!r})")
                continue
            unknown = _overrides.override_key_errors(ctx, entry, where)
            errors += unknown
            if not unknown and entry:
                errors += _overrides.overridden_model_errors(ctx, entry, where)
        return errors

    # ------------------------------------------------------------------ data
    def prepare(self, ds, tokenizer, ctx: BuildContext) -> tuple[Any, DataStats]:
        """Prompt tokens (chat template with the generation prompt, cut from the left) and the
        reference answer text, from conversations or preference rows."""
        cols = set(ds.column_names)
        if "messages" not in cols and "prompt" not in cols:
            raise DataError(f"method=grpo needs rows with 'messages' (a conversation ending in "
                            f"an assistant turn) or 'prompt' (+ optional 'chosen'); this "
                            f"dataset has columns {sorted(cols)}")
        limit = self.max_prompt_length

        def fn(row: dict, idx: int) -> list[dict]:
            prompt, reference = _prompt_and_reference(row, idx)
            ids = _rows.encode_prompt(tokenizer, prompt, idx, row.get("tools"))
            n_in = len(ids)
            if limit is not None and len(ids) > limit:
                ids = ids[len(ids) - limit:]
            return [{"prompt_ids": ids, "reference": reference, "n_in": n_in,
                     "prompt_text": tokenizer.decode(ids, skip_special_tokens=False)}]

        key = ("grpo", limit, tokenizer.name_or_path, len(tokenizer))
        out = _rows.map_rows(ds, fn, ["prompt_ids", "reference", "n_in", "prompt_text"], key,
                         "tokenize prompts")
        n_in = sum(out["n_in"])
        kept = sum(len(x) for x in out["prompt_ids"])
        out = out.remove_columns(["n_in"])
        stats = DataStats(examples=len(ds), rows=len(out), tokens_in=n_in,
                          tokens_dropped=n_in - kept)
        return out, stats

    def collate(self, rows: list[dict], tokenizer, ctx: BuildContext) -> Batch:
        """Left-padded prompts ``[B, P]``: generation appends to the right end of every row."""
        pad = tokenizer.pad_token_id
        width = max(len(r["prompt_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["prompt_ids"])
            ids[i, width - n:] = torch.tensor(r["prompt_ids"], dtype=torch.long)
            mask[i, width - n:] = 1
        real = int(mask.sum())
        return Batch({"prompt_ids": ids, "prompt_mask": mask}, num_items=0, real_tokens=real,
                     total_tokens=ids.numel(), size_key=(len(rows), width),
                     meta={"samples": len(rows) * self.num_generations,
                           "references": [r["reference"] for r in rows],
                           "prompts": [r["prompt_text"] for r in rows],
                           "eos": tokenizer.eos_token_id, "pad": pad,
                           "decode": tokenizer.batch_decode})

    # ------------------------------------------------------------------ models
    def extra_models(self, policy, ctx: BuildContext, build: ModelFactory) -> dict[str, nn.Module]:
        models = _reference.reference_models(self, policy, ctx, build) if self.beta > 0 else {}
        return {**models, **self.reward_model_instances(build)}

    def reward_model_instances(self, build: ModelFactory) -> dict[str, nn.Module]:
        """``reward_model_<i>``: each entry of ``reward_models`` loaded frozen with a
        one-output sequence-classification head and its own tokenizer."""
        return {f"reward_model_{i}": _rewards.RewardModel(build(entry or None, head="seq_cls"),
                                                 build.tokenizer(entry or None))
                for i, entry in enumerate(self.reward_models)}

    def before_training(self, models, ds, ctx: BuildContext):
        return None

    # ------------------------------------------------------------------ capabilities
    def as_generating(self) -> Generating | None:
        return self

    def as_group_packed(self) -> GroupPacked | None:
        return None

    def row_length(self) -> int | None:
        return self.max_prompt_length

    def pad_multiple(self) -> int | None:
        return None

    def keeps_row_end(self) -> bool:
        return False

    def packs_rows(self, ctx: BuildContext) -> bool:
        return False

    def uses_liger(self) -> bool:
        return False

    def liger_model_kernels(self) -> tuple[str, ...]:
        return ()

    def reads_head_weight(self, ctx: BuildContext) -> str | None:
        return None

    # ------------------------------------------------------------------ generation
    def sampling_length(self) -> int:
        return self.max_completion_length

    def rows_per_prompt(self) -> int:
        return self.num_generations

    def sampling(self, batch: Batch) -> SamplingParams:
        """The sampling request of this method for ``batch``'s prompts."""
        return SamplingParams(max_new_tokens=self.max_completion_length,
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              eos=batch.meta["eos"], pad=batch.meta["pad"])

    def rollout(self, models: dict, batch: Batch, ctx: BuildContext, env: GenerationEnv) -> Batch:
        """Sample completions with the run's engine, score them, and return the training
        batch: prompt + completion rows ``[B*G, P+L]`` with advantages and the
        completion-token mask."""
        g = self.num_generations
        prompt = batch.tensors["prompt_ids"].repeat_interleave(g, 0)
        pmask = batch.tensors["prompt_mask"].repeat_interleave(g, 0)
        samples = env.engine.generate(models["policy"], prompt, pmask, self.sampling(batch))
        rewards, metrics = self.score(batch, samples, models)
        out = self.training_batch(models, batch, prompt, pmask, samples, rewards, metrics)
        out.meta["counts"] = _rewards.reward_groups(rewards, self.num_generations)
        if samples.logprobs is not None and env.engine.corrects_sampling():
            self.correct_sampling(models, out, samples.logprobs, env.engine, prompt.shape[1])
        return out

    def evaluate(self, models: dict, batch: Batch, ctx: BuildContext, env: GenerationEnv
                 ) -> tuple[dict[str, float], int]:
        """One greedy completion per held-out prompt from the run's engine, scored by the
        run's rewards: the reward (and each reward's share, the completions' length and
        whether they ended) summed over the prompts."""
        t = batch.tensors
        params = dataclasses.replace(self.sampling(batch), greedy=True)
        samples = env.engine.generate(models["policy"], t["prompt_ids"], t["prompt_mask"], params)
        rewards, metrics = dataclasses.replace(self, num_generations=1).score(batch, samples,
                                                                              models)
        n = len(samples.token_ids)
        sums = {k: v * n for k, v in metrics.items()}
        sums.update({"reward": float(rewards.sum()),
                     "completions/mean_length": float(sum(samples.lengths)),
                     "completions/finished": float(sum(samples.finished_list))})
        return sums, n

    def correct_sampling(self, models: dict, out: Batch, sampler_logps: torch.Tensor,
                         engine: Engine, prompt_width: int) -> None:
        """Weight each completion token by the engine's correction of the mismatch between
        the sampler's log-probs (``sampler_logps``, ``[N, L]``) and the trainer's
        (``is_weights``; methods that declare ``supports_sampling_correction`` apply them in
        their loss). The trainer's log-probs are those of the policy at generation time (one
        no-grad forward, shared with ``old_logps`` when the method records them)."""
        t = out.tensors
        labels = t["labels"][:, :-1]
        old = t.get("old_logps")
        if old is None:
            with torch.no_grad():
                logits = models["policy"](**model_inputs(t), use_cache=False).logits[:, :-1]
                old = token_logps(logits, labels, IGNORE)
            del logits
        sampler = torch.zeros_like(old)
        width = sampler_logps.shape[1]
        sampler[:, prompt_width - 1: prompt_width - 1 + width] = sampler_logps.to(old)
        corrected = engine.importance_weights(old, sampler, labels != IGNORE)
        if corrected is None:  # the engine applies no correction after all
            return
        weights, metrics = corrected
        t["is_weights"] = weights.to(old.device)
        out.meta["rollout"].update(metrics)

    def score(self, batch: Batch, samples: Samples, models: dict
              ) -> tuple[torch.Tensor, dict[str, float]]:
        """The weighted sum of the reward functions and reward models for each completion
        ``[N]`` (float32, on the host) and one metric per reward. Reads the completions' text
        (decoded from the samples' host token ids)."""
        g = self.num_generations
        comp_ids = samples.token_ids
        texts = batch.meta["decode"](comp_ids, skip_special_tokens=True)
        refs = [r for r in batch.meta["references"] for _ in range(g)]
        prompts = [p for p in batch.meta["prompts"] for _ in range(g)]
        weights = self.reward_weights or [1.0] * (len(self.rewards) + len(self.reward_models))
        total = torch.zeros(len(comp_ids), dtype=torch.float32)
        metrics: dict[str, float] = {}
        full = [p + c for p, c in zip(prompts, texts, strict=True)]
        for i in range(len(self.reward_models)):
            r = models[f"reward_model_{i}"].score(full)
            metrics[f"rewards/model_{i}"] = float(r.mean())
            total += weights[len(self.rewards) + i] * r
        for name, w in zip(self.rewards, weights, strict=False):
            fn = _rewards.resolve(name, self)
            r = torch.tensor(fn(texts, prompts=prompts, references=refs, completion_ids=comp_ids,
                                finished=list(samples.finished_list)), dtype=torch.float32)
            if r.shape != total.shape:
                raise ValueError(f"reward {name!r} returned {r.numel()} values for "
                                 f"{total.numel()} completions")
            metrics[f"rewards/{name.split(':')[-1]}"] = float(r.mean())
            total += w * r
        return total, metrics

    def training_batch(self, models: dict, batch: Batch, prompt: torch.Tensor,
                       pmask: torch.Tensor, samples: Samples, rewards: torch.Tensor,
                       metrics: dict[str, float]) -> Batch:
        """Prompt + completion rows with labels on the completion tokens, the loss mask and the
        method's advantages (``advantages_for``, which may run the reference / value model).
        Token counts come from the samples' host copies (no device read)."""
        g = self.num_generations
        comp, cmask, finished = samples.completion, samples.mask, samples.finished
        t = join(prompt, pmask, comp, cmask)
        ids, labels = t["input_ids"], t["labels"]
        valid = [True] * len(samples.token_ids)
        loss_mask = torch.ones(comp.shape[0], dtype=torch.bool, device=finished.device)
        if self.mask_truncated_completions:
            valid = list(samples.finished_list)
            loss_mask = finished.clone()
            labels[~loss_mask.to(labels.device)] = IGNORE
        lengths = samples.lengths
        n_tokens = sum(n for n, v in zip(lengths, valid, strict=True) if v)
        items = self.num_items(n_tokens, sum(valid))
        metrics.update({
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.view(-1, g).std(1).mean()) if g > 1 else 0.0,
            "completions/mean_length": sum(lengths) / max(1, len(lengths)),
            "completions/finished": sum(samples.finished_list) / max(1, len(lengths)),
        })
        t.update(seq_valid=loss_mask.to(ids.device), finished=finished.to(ids.device))
        t["advantages"] = self.advantages_for(models, rewards, t, metrics).to(ids.device)
        return Batch(t, num_items=items, real_tokens=batch.real_tokens * g + sum(lengths),
                     total_tokens=ids.numel(), size_key=tuple(ids.shape),
                     meta={**batch.meta, "rollout": metrics})

    # ------------------------------------------------------------------ per method
    def advantages_for(self, models: dict, rewards: torch.Tensor, t: dict[str, torch.Tensor],
                       metrics: dict[str, float]) -> torch.Tensor:
        """One advantage per completion from ``rewards`` (``[prompts * num_generations]``);
        ``t`` holds the training tensors (input_ids, attention_mask, position_ids, labels)."""
        raise NotImplementedError

    def num_items(self, completion_tokens: int, completions: int) -> int:
        """The rollout's share of the step's loss normaliser."""
        raise NotImplementedError


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


def _prompt_and_reference(row: dict, idx: int) -> tuple[Any, str]:
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


@dataclass(kw_only=True)
class Clipped(Online):
    """Online methods with a clipped probability-ratio surrogate (GRPO, RLOO)."""

    epsilon: PositiveFloat = 0.2
    epsilon_high: PositiveFloat | None = None
    """Upper clip (DAPO's clip-higher); None = epsilon."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if self.epsilon <= 0 or (self.epsilon_high is not None and self.epsilon_high <= 0):
            errors.append("method.epsilon and method.epsilon_high must be > 0")
        return errors

    def clip_high(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon

    def training_batch(self, models: dict, batch: Batch, *args: Any) -> Batch:
        """The rollout's training batch; with ``num_iterations > 1`` also the policy's
        per-token log-probs at generation time (``old_logps``, no gradient)."""
        out = super().training_batch(models, batch, *args)
        if self.num_iterations > 1:
            t = out.tensors
            with torch.no_grad():
                logits = models["policy"](**model_inputs(t), use_cache=False).logits[:, :-1]
                t["old_logps"] = token_logps(logits, t["labels"][:, :-1], IGNORE)
            del logits
        return out

    @staticmethod
    def ratio(logps: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        """``exp(logps - old)``; on-policy (``old`` None) ``old = logps.detach()``: 1 in value,
        the policy gradient in gradient."""
        return torch.exp(logps - (logps.detach() if old is None else old.to(logps.dtype)))

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-element surrogate ``-min(ratio A, clip(ratio) A)`` and where the clip is
        active (no gradient through the ratio there)."""
        lo, hi = 1 - self.epsilon, 1 + self.clip_high()
        loss = -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        active = ((ratio < lo) & (adv < 0)) | ((ratio > hi) & (adv > 0))
        return loss, active

