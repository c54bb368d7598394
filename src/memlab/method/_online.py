"""What the online methods (``grpo``, ``rloo``, ``online_dpo``, ``ppo``) share: the knobs, and
the steps of a rollout: sampling ``num_generations`` completions per prompt with the run's
generation engine (``generation=``), scoring them with reward functions and reward models, and
laying out the training batch.

Not an option of its own (the registry skips modules whose name starts with ``_``). A method
subclasses :class:`Online` and supplies ``advantages_for`` (rewards -> one advantage per
completion), ``num_items`` (the loss normaliser of a rollout) and ``loss``; its rollout is
:meth:`Online.rollout`'s steps (``method=grpo`` writes them out: ``memlab.method.grpo``):

    generate -> score (rewards) -> rows -> advantages_for -> batch_of [-> old log-probs]
             -> finish (reward groups, sampling correction)

Generation runs in the trainer's ``generate`` phase (measured like forward and backward)
through the engine the run's ``generation`` option built (``memlab.generation``: transformers'
``generate`` on the policy by default, inside its distributed wrapper). The engine returns host
copies of the completions' tokens, so scoring and counting read no device tensor.
``train.batch_size`` counts prompts (each becomes ``num_generations`` sequences); the engine
prefills each prompt once for its whole group (``SamplingParams.n``). Every method here takes one
optimisation pass per generation batch (on-policy: the probability ratio is 1 in value and
carries the policy gradient). The prompts, the reward functions and models, and the training
batch's tensors with the per-token values its loss reads are :mod:`memlab.method._rollout`'s
(padded, padding-free or shared-prompt rows; the output head only where a completion token is
predicted; completions whose loss term is zero left out).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import torch
from torch import nn

from memlab.generation.base import Engine, GenerationEnv, Samples, SamplingParams
from memlab.method import _layout, _reference, _rollout, _rows
from memlab.method._knobs import (
    CompletionLength,
    HeadOn,
    PaddingFree,
    PromptLength,
    SharePrompt,
)
from memlab.method.base import (
    Batch,
    DataStats,
    ExtraModels,
    Generating,
    ModelFactory,
    NoCapabilities,
    RowLayout,
    drops_padding_mask,
)
from memlab.model.base import Head
from memlab.registry import NonNegativeFloat, PositiveFloat, PositiveInt, Range

if TYPE_CHECKING:
    from memlab.context import BuildContext


@dataclass
class Rows:
    """A rollout's completions laid out in training rows, before their advantages
    (:meth:`Online.rows`)."""

    tensors: dict[str, Any]
    laid_out: set[str]
    """The keys of ``tensors`` the layout made (a relayout replaces them)."""
    keep: list[bool]
    """Per completion: placed in the rows."""
    items: int
    """The rollout's share of the step's loss normaliser."""
    stored: int
    slots: int
    metrics: dict[str, float]


@dataclass(kw_only=True)
class Online(HeadOn, SharePrompt, PaddingFree, CompletionLength, PromptLength,
             NoCapabilities):
    """Knobs every online method has, named as in TRL's GRPOConfig / RLOOConfig."""

    num_generations: PositiveInt = 4
    """Completions sampled per prompt (the group whose mean reward is the baseline)."""
    max_prompt_length: PositiveInt | None = 256
    max_completion_length: PositiveInt = 64
    temperature: PositiveFloat = 1.0
    """Sampling temperature of the completions (the loss's log-probs are the model's own, at
    temperature 1)."""
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0:
    all)."""
    top_k: PositiveInt | None = None
    """Sample from the k most likely tokens only (None: all)."""
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
    share_prompt: bool | None = None  # type: ignore[assignment]  # None: where it can

    data_kinds: ClassVar[tuple[str, ...]] = ("chat", "preference")
    head: ClassVar[Head] = "causal_lm"
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
        errors += _rollout.reward_errors(self, ctx)
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
        if self.share_prompt:  # asked for explicitly (None turns on only where it can)
            errors += _layout.shared_prompt_errors(
                ctx, "each prompt once for its completions, each completion seeing it and not "
                "the other completions")
        return errors

    # ------------------------------------------------------------------ data
    def prepare(self, ds, tokenizer, ctx: BuildContext) -> tuple[Any, DataStats]:
        """Prompt tokens and reference answers (:func:`memlab.method._rollout.prompt_rows`)."""
        return _rollout.prompt_rows(ds, tokenizer, self.max_prompt_length)

    def collate(self, rows: list[dict], tokenizer, ctx: BuildContext) -> Batch:
        """Left-padded prompts (:func:`memlab.method._rollout.prompt_batch`)."""
        return _rollout.prompt_batch(rows, tokenizer, self.num_generations)

    # ------------------------------------------------------------------ models
    def extra_models(self, policy, ctx: BuildContext, build: ModelFactory) -> dict[str, nn.Module]:
        models = _reference.reference_models(self, policy, ctx, build) if self.beta > 0 else {}
        return {**models, **self.reward_model_instances(build)}

    def reward_model_instances(self, build: ModelFactory) -> dict[str, nn.Module]:
        """``reward_model_<i>``: each entry of ``reward_models`` loaded frozen with a
        one-output sequence-classification head and its own tokenizer."""
        return {f"reward_model_{i}": _rollout.RewardModel(build(entry or None, head="seq_cls"),
                                                          build.tokenizer(entry or None))
                for i, entry in enumerate(self.reward_models)}

    def before_training(self, models, ds, ctx: BuildContext):
        return None

    # ------------------------------------------------------------------ capabilities
    def as_generating(self) -> Generating | None:
        return self

    def as_extra_models(self) -> ExtraModels | None:
        return self

    def row_layout(self, ctx: BuildContext) -> RowLayout:
        return RowLayout(supports_packing=False, supports_padding_free=True,
                         packs_rows=self.padding_free or self.shares_prompt(ctx),
                         row_length=self.max_prompt_length, pad_to_multiple_of=None,
                         keeps_row_end=False)

    def shares_prompt(self, ctx: BuildContext | None) -> bool:
        """Whether a group's prompt is stored once (``share_prompt``; None: where the attention
        can show a document a prefix; without a run context, off)."""
        if self.share_prompt is not None:
            return self.share_prompt
        return ctx is not None and ctx.attention.shares_prefix()

    def labelled(self) -> bool:
        """Whether the output head runs at the scored positions only (``head_on``)."""
        return self.head_on == "labelled"

    # ------------------------------------------------------------------ generation
    def sampling_length(self) -> int:
        return self.max_completion_length

    def rows_per_prompt(self) -> int:
        return self.num_generations

    def sampling(self, batch: Batch) -> SamplingParams:
        """The sampling request of this method for ``batch``'s prompts."""
        return SamplingParams(max_new_tokens=self.max_completion_length,
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              eos=batch.meta["eos"], pad=batch.meta["pad"],
                              n=self.num_generations)

    def rollout(self, models: dict, batch: Batch, ctx: BuildContext, env: GenerationEnv) -> Batch:
        """Sample ``num_generations`` completions per prompt with the run's engine (each prompt
        prefilled once), score them, and return the training batch
        (:meth:`training_batch`)."""
        samples = self.generate(models, batch, env)
        rewards, metrics = self.score(batch, samples, models)
        real = not env.engine.placeholder_samples
        out = self.training_batch(models, batch, samples, rewards, metrics, ctx, real=real)
        return self.finish(models, out, samples, rewards, env, ctx, real)

    def generate(self, models: dict, batch: Batch, env: GenerationEnv) -> Samples:
        """``num_generations`` completions of each of ``batch``'s prompts from the run's engine
        (:meth:`sampling`), their tokens copied to the host."""
        return env.engine.generate(models["policy"], batch.tensors["prompt_ids"],
                                   batch.tensors["prompt_mask"], self.sampling(batch))

    def finish(self, models: dict, out: Batch, samples: Samples, rewards: torch.Tensor,
               env: GenerationEnv, ctx: BuildContext, real: bool) -> Batch:
        """The rollout's reward groups (``real`` samples only: an estimate's placeholders have
        no rewards to count) and, where the engine corrects its sampling, the importance
        weights (:meth:`correct_sampling`)."""
        if real:
            out.meta["counts"] = _rollout.reward_groups(rewards, self.num_generations)
        if samples.logprobs is not None and env.engine.corrects_sampling():
            self.correct_sampling(models, out, samples, env.engine, ctx)
        return out

    def evaluate(self, models: dict, batch: Batch, ctx: BuildContext, env: GenerationEnv
                 ) -> tuple[dict[str, float], int]:
        """One greedy completion per held-out prompt from the run's engine, scored by the
        run's rewards: the reward (and each reward's share, the completions' length and
        whether they ended) summed over the prompts."""
        t = batch.tensors
        params = dataclasses.replace(self.sampling(batch), greedy=True, n=1)
        samples = env.engine.generate(models["policy"], t["prompt_ids"], t["prompt_mask"], params)
        rewards, metrics = dataclasses.replace(self, num_generations=1).score(batch, samples,
                                                                              models)
        n = len(samples.token_ids)
        sums = {k: v * n for k, v in metrics.items()}
        sums.update({"reward": float(rewards.sum()),
                     "completions/mean_length": float(sum(samples.lengths)),
                     "completions/finished": float(sum(samples.finished_list))})
        return sums, n

    def correct_sampling(self, models: dict, out: Batch, samples: Samples, engine: Engine,
                         ctx: BuildContext) -> None:
        """Weight each completion token by the engine's correction of the mismatch between
        the sampler's log-probs (``samples.logprobs``, ``[N, L]``) and the trainer's
        (``is_weights``; methods that declare ``supports_sampling_correction`` apply them in
        their loss). The trainer's log-probs are those of the policy at generation time (one
        no-grad forward, shared with ``old_logps`` when the method records them)."""
        t = out.tensors
        mask = t["completion_mask"]
        old = t.get("old_logps")
        if old is None:
            with torch.no_grad():
                old = self.completion_logps(models["policy"], t, ctx)
        assert samples.logprobs is not None
        sampler = samples.logprobs[:, : mask.shape[1]].to(old)
        corrected = engine.importance_weights(old, sampler * mask, mask.bool())
        if corrected is None:  # the engine applies no correction after all
            return
        weights, metrics = corrected
        t["is_weights"] = weights.to(old.device)
        out.meta["rollout"].update(metrics)

    def completion_logps(self, model, t: dict[str, Any], ctx) -> torch.Tensor:
        """``[N, L]`` log-probs of the completion tokens of training tensors ``t`` under
        ``model`` (:func:`memlab.method._rollout.completion_logps`)."""
        return _rollout.completion_logps(model, t, self.labelled(), _layout.attention_of(ctx))

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
            fn = _rollout.resolve(name, self)
            r = torch.tensor(fn(texts, prompts=prompts, references=refs, completion_ids=comp_ids,
                                finished=list(samples.finished_list)), dtype=torch.float32)
            if r.shape != total.shape:
                raise ValueError(f"reward {name!r} returned {r.numel()} values for "
                                 f"{total.numel()} completions")
            metrics[f"rewards/{name.split(':')[-1]}"] = float(r.mean())
            total += w * r
        return total, metrics

    def training_batch(self, models: dict, batch: Batch, samples: Samples,
                       rewards: torch.Tensor, metrics: dict[str, float], ctx,
                       real: bool = True) -> Batch:
        """The training batch (:mod:`memlab.method._rollout`) with the completion mask, the
        method's advantages (``advantages_for``, which may run the reference / value model on
        the laid-out rows) and, where the method says a completion's loss term is zero, without
        it (:meth:`rows`, then :meth:`batch_of`)."""
        rows = self.rows(batch, samples, rewards, metrics, ctx, real)
        adv = self.advantages_for(models, rewards, rows.tensors, metrics, ctx)
        return self.batch_of(rows, adv, batch, samples, ctx, real)

    def rows(self, batch: Batch, samples: Samples, rewards: torch.Tensor,
             metrics: dict[str, float], ctx, real: bool = True) -> Rows:
        """The completions laid out in training rows (:meth:`layout`), with the rollout's
        metrics and loss normaliser. Token counts come from the samples' host copies (no device
        read). ``real``: the samples are real (an estimate's placeholders: every completion is
        kept and scored, the worst case)."""
        g = self.num_generations
        lengths = samples.lengths
        valid = [True] * len(lengths)
        if self.mask_truncated_completions:
            valid = list(samples.finished_list)
        n_tokens = sum(n for n, v in zip(lengths, valid, strict=True) if v)
        items = self.num_items(n_tokens, sum(valid))
        metrics.update({
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.view(-1, g).std(1).mean()) if g > 1 else 0.0,
            "completions/mean_length": sum(lengths) / max(1, len(lengths)),
            "completions/finished": sum(samples.finished_list) / max(1, len(lengths)),
        })
        keep = valid if real else [True] * len(lengths)
        device = batch.tensors["prompt_ids"].device
        t, stored, slots = self.layout(batch, samples, keep, ctx, device)
        laid_out = set(t)
        t.update(seq_valid=torch.tensor(valid, device=device),
                 finished=samples.finished.to(device))
        return Rows(t, laid_out, keep, items, stored, slots, metrics)

    def batch_of(self, rows: Rows, adv: torch.Tensor, batch: Batch, samples: Samples, ctx,
                 real: bool = True) -> Batch:
        """The training batch of ``rows`` with their advantages ``adv``; (``real`` samples)
        laid out again without the completions whose loss term is zero (``zero_contribution``:
        the per-completion values stay)."""
        t, keep, stored, slots = rows.tensors, rows.keep, rows.stored, rows.slots
        device = batch.tensors["prompt_ids"].device
        t["advantages"] = adv.to(device)
        if real:
            zero = self.zero_contribution(adv)
            dropped = [k and z for k, z in zip(keep, zero, strict=True)]
            rows.metrics["completions/skipped"] = sum(dropped) / len(keep)
            if any(dropped):  # the same batch without them (the per-completion values stay)
                keep = [k and not z for k, z in zip(keep, zero, strict=True)]
                new, stored, slots = self.layout(batch, samples, keep, ctx, device)
                t = {**{k: v for k, v in t.items() if k not in rows.laid_out}, **new}
        return Batch(t, num_items=rows.items, real_tokens=stored, total_tokens=slots,
                     size_key=batch.size_key, meta={**batch.meta, "rollout": rows.metrics})

    def layout(self, batch: Batch, samples: Samples, keep: list[bool], ctx,
               device: torch.device | str = "cpu") -> tuple[dict[str, Any], int, int]:
        """The training tensors of the completions ``keep`` marks, laid out on the host and
        moved to ``device``; the tokens they store and their slots."""
        t, stored, slots = _rollout.training_tensors(
            batch.meta["prompt_ids"], samples.token_ids, keep, self.num_generations,
            batch.meta["pad"], share=self.shares_prompt(ctx), flat=self.padding_free,
            mask=not drops_padding_mask(self.padding_mask, ctx),
            width=samples.completion.shape[1])
        return ({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()},
                stored, slots)

    def worst_case_tensors(self, batch: Batch, new_tokens: int, token: int, ctx
                           ) -> dict[str, torch.Tensor]:
        """The training tensors of ``batch``'s rollout where every completion runs to
        ``new_tokens`` tokens (``token`` repeated), with real values: what an estimate's fake
        step lays out (:meth:`training_batch` with placeholder samples)."""
        n = len(batch.meta["prompt_ids"]) * self.num_generations
        comp = torch.full((n, new_tokens), token, dtype=torch.long)
        samples = Samples(comp, torch.ones_like(comp), torch.zeros(n, dtype=torch.bool),
                          [[token] * new_tokens for _ in range(n)], [False] * n)
        return self.layout(batch, samples, [True] * n, ctx)[0]

    # ------------------------------------------------------------------ per method
    def advantages_for(self, models: dict, rewards: torch.Tensor, t: dict[str, torch.Tensor],
                       metrics: dict[str, float], ctx) -> torch.Tensor:
        """One advantage per completion from ``rewards`` (``[prompts * num_generations]``);
        ``t`` holds the training tensors (:mod:`memlab.method._rollout`)."""
        raise NotImplementedError

    def zero_contribution(self, advantages: torch.Tensor) -> list[bool]:
        """Per completion: whether its loss term (and gradient) is zero whatever the policy, so
        that it can be left out of the training batch (default: never)."""
        return [False] * advantages.shape[0]

    def num_items(self, completion_tokens: int, completions: int) -> int:
        """The rollout's share of the step's loss normaliser."""
        raise NotImplementedError


@dataclass(kw_only=True)
class Clipped(Online):
    """Online methods with a clipped probability-ratio surrogate (GRPO, RLOO)."""

    epsilon: PositiveFloat = 0.2
    """Lower clip of the probability ratio, 1 - epsilon (and the upper one unless epsilon_high
    is set)."""
    epsilon_high: PositiveFloat | None = None
    """Upper clip (DAPO's clip-higher); None = epsilon."""

    def validate(self, ctx: BuildContext) -> list[str]:
        errors = super().validate(ctx)
        if self.epsilon <= 0 or (self.epsilon_high is not None and self.epsilon_high <= 0):
            errors.append("method.epsilon and method.epsilon_high must be > 0")
        return errors

    def clip_high(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon

    def training_batch(self, models: dict, batch: Batch, samples: Samples,
                       rewards: torch.Tensor, metrics: dict[str, float], ctx,
                       real: bool = True) -> Batch:
        """The rollout's training batch; with ``num_iterations > 1`` also the policy's
        per-token log-probs at generation time (``old_logps``, no gradient)."""
        out = super().training_batch(models, batch, samples, rewards, metrics, ctx, real)
        if self.num_iterations > 1:
            out.tensors["old_logps"] = self.old_logps(models, out, ctx)
        return out

    def old_logps(self, models: dict, out: Batch, ctx) -> torch.Tensor:
        """The policy's per-token log-probs of ``out``'s completions at generation time (no
        gradient): what the probability ratio of the later ``num_iterations`` compares with."""
        with torch.no_grad():
            return self.completion_logps(models["policy"], out.tensors, ctx)

    def zero_contribution(self, advantages: torch.Tensor) -> list[bool]:
        """A completion whose advantage is exactly 0 adds ``-min(ratio * 0, clip * 0) = 0``
        (and no gradient) to the clipped surrogate; a method that adds a per-token term (GRPO's
        KL) narrows this."""
        return (advantages == 0).tolist()

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

