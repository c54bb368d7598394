"""The one assembly function, for a training run and for ``memlab estimate`` alike.

The order in which :func:`build` runs, and why:

1. tokenizer (model group): the data steps need it.
2. the training rows: data source (less the rows a fraction ``data.eval`` holds out) ->
   conversion to memlab's row formats -> method.prepare (chat template, tokenize, truncate,
   shifted labels) -> packing.apply. Labels are shifted per document *before* packing, so no
   token is ever trained to predict the first token of the next document in a packed row.
   Truncation happens before packing except for strategies that keep overflow tokens
   themselves (bfd_split, wrapped). The rows are then checked: a warning above
   ``data.max_hollow_fraction`` hollow examples; a DataError (status ``invalid``) when nothing
   is left to train on or, in a run, when the rows cannot fill one micro-batch of
   ``train.batch_size`` rows on every process.
3. model: attention backend and parameter dtype are chosen at load (transformers builds
   its attention modules from them; quantization too, for qlora), then the method's Liger
   kernels (``method.use_liger_kernel``).
4. peft: adapters on the loaded model (before checkpointing, which must see the final modules).
5. gradient checkpointing (non-reentrant, every k-th layer), then activation offload hooks:
   offload wraps the forward outside checkpointing, so only what checkpointing still saves is
   moved off the device.
6. distributed wrap, last of the policy's steps (DDP wraps the finished module; each rank runs
   this same build and streams its own slice of every global batch, step 10).
7. extra models the method needs (reference, teacher, reward, value...), built by the same
   loader (optionally with model-group overrides: a teacher of another size).
8. the held-out data (``data.eval``): read, converted, prepared and packed as the training rows
   are (its own micro-batch size, ``train.eval_batch_size``), before the one-off pass.
9. the method's one-off pass (``before_training``) over the training and held-out rows
   together, which may return them with added columns (DPO's precomputed reference log-probs,
   so the held-out rows have them too) and drop a model it no longer needs.
10. collator: the method's, over the rows step 9 returned, told by packing / padding_free /
    pad_to_multiple_of how to shape rows (padded with an attention mask, or flat with
    restarting position_ids and the rows' document segments); the stream of micro-batches
    takes ``packing.batch_items`` items per micro-batch (one where a dataset's units were
    packed in groups, preference pairs: each item is a micro-batch) and this rank's slice.
11. online methods: the generation engine (``generation=``) and the run's random draws.
12. the evaluator (with held-out data), then the trainer: it builds the optimizer (or takes
    the one DeepSpeed's engine built), the schedule and the memory probe; its loop runs the
    steps (forward, backward, optimizer step) when the run calls it, after ``build`` returns.

What differs between a run and an estimate is passed in as :class:`Seams` (the estimator's
model loader builds fake weights, its rows are the worst-case batch, its engine decodes to the
full length, ...). Nothing else differs; nothing here is patched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from torch import nn

from memlab import faults
from memlab.data import chat, heldout
from memlab.data.base import DataError
from memlab.generation.base import Engine, GenerationEnv, SamplingParams, run_rng
from memlab.generation.hf import HFEngine
from memlab.measure import runlog
from memlab.measure.data import DataStats
from memlab.method import _rows
from memlab.model._liger import apply_liger
from memlab.offload.base import Placement
from memlab.trainer.batch import BatchStream
from memlab.trainer.evaluate import Evaluator
from memlab.trainer.loop import LoopOptions, Trainer
from memlab.trainer.routing import base_model

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.model.base import Head


@dataclass(frozen=True)
class Seams:
    """The explicit injection points of :func:`build` (defaults: a training run).

    Each is None / its default in a run; ``memlab estimate`` passes its own."""

    load_tokenizer: Callable[[Any], Any] | None = None
    """``ctx -> tokenizer`` (default: the model group's ``load_tokenizer``)."""
    load_model: Callable[..., nn.Module] | None = None
    """``(ctx, tokenizer, head, extra) -> model`` for ``ctx.model`` (default: the model group's
    ``load``); ``extra`` holds the PEFT option's load arguments."""
    build_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Entered while a model is built (loaded, PEFT, checkpointing)."""
    place_model: Callable[[nn.Module], nn.Module] | None = None
    """Applied to every built model before it is used (default: none; models load on the
    run's device)."""
    prepare_data: Callable[[Any, Any], tuple[Any, DataStats]] | None = None
    """``(ctx, tokenizer) -> (prepared dataset, stats)`` (default: :func:`prepare_data`)."""
    offload: Placement | None = None
    """Where the offload option puts activations and which tensors it handles."""
    engine: Callable[[Any, Any, nn.Module], Engine] | None = None
    """``(ctx, tokenizer, policy) -> engine`` for every model an online method samples from
    (default: the generation option's engine for the policy, transformers' for others)."""
    rng: random.Random | None = None
    """The rollouts' random draws (default: seeded by ``train.seed`` and the rank)."""
    exact_weights: bool = True
    """Whether models hold real values (checks that compare weights run only then)."""
    model_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Entered around the method's one-off pass over the models (``before_training``)."""
    prepare_eval: Callable[[Any, Any], HeldOut | None] | None = None
    """``(ctx, tokenizer) -> the held-out data`` (default: :func:`prepare_eval`)."""
    loop: LoopOptions = field(default_factory=LoopOptions)


@dataclass
class HeldOut:
    """The held-out data (``data.eval``) as the evaluator reads it."""

    ds: Any
    """Prepared and packed rows (``train.eval_batch_size`` rows per micro-batch)."""
    stats: DataStats
    source: str
    """Where the rows come from, in words."""
    prompts: list[list[int]] = field(default_factory=list)
    """Token ids of the ``train.eval_samples`` sample prompts."""

    def describe(self) -> dict[str, Any]:
        """summary.json's ``eval`` entries about the rows."""
        st = self.stats
        return {"source": self.source, "examples": st.examples, "rows": st.rows,
                "tokens": st.tokens_in - st.tokens_dropped,
                "trainable_tokens": st.trainable_tokens}


@dataclass
class Pipeline:
    tokenizer: Any
    dataset: Any
    stats: DataStats
    models: dict[str, nn.Module]
    stream: BatchStream
    offload: Any
    generation: GenerationEnv | None
    trainer: Trainer
    held_out: HeldOut | None = None


def prepare_rows(ctx: BuildContext, tokenizer) -> tuple[Any, Any, DataStats, chat.Tally]:
    """Data source -> conversion to memlab's row formats -> method transforms (with the data
    option's chat-template settings): ``(rows as read, prepared rows, stats, what the chat
    templates did)``. What the conversion and the templates did goes into the stats' extras
    (``converted``, ``chat_template``, ``unsplittable``)."""
    faults.reach("data")
    with runlog.datasets_bars(False):  # one bar: the method's preparation (tokenize)
        raw = heldout.hold_out(ctx.data, ctx.data.load(ctx))  # less a fraction held out
    if len(raw) == 0:
        raise DataError(f"data={ctx.data.name}: the data source has no rows")
    try:
        with runlog.datasets_bars(False):
            rows, converted = ctx.data.convert(raw)
        with chat.rendering(tokenizer, ctx.data) as tally:
            ds, stats = ctx.method.prepare(rows, tokenizer, ctx)
    except DataError as e:  # name where the row comes from: a file and line, a hub row...
        if e.row is None:
            raise
        raise DataError(f"{ctx.data.locate(raw, e.row)}: {e}", row=e.row) from e
    if converted:
        stats.extra["converted"] = converted
    stats.extra.update(tally.as_dict(lambda row: ctx.data.locate(raw, row)))
    stats.extra.update(ctx.data.summary(raw))
    return raw, ds, stats, tally


def prepare_data(ctx: BuildContext, tokenizer) -> tuple[Any, DataStats]:
    """:func:`prepare_rows` -> packing."""
    _, ds, stats, _ = prepare_rows(ctx, tokenizer)
    return pack(ctx, ds, stats)


def eval_context(ctx: BuildContext) -> BuildContext:
    """``ctx`` with ``train.eval_batch_size`` rows per micro-batch (what packing and the
    evaluator's batches read)."""
    return dataclasses.replace(ctx, train=dataclasses.replace(
        ctx.train, batch_size=ctx.train.eval_rows()))


def prepare_eval(ctx: BuildContext, tokenizer: Any) -> HeldOut | None:
    """The held-out rows (``data.eval``; :mod:`memlab.data.heldout`) through the steps the
    training rows take: conversion, the chat template with the data option's settings, the
    method's preparation, packing (with ``train.eval_batch_size``); plus the sample prompts'
    token ids. None without ``data.eval``."""
    with runlog.datasets_bars(False):  # (the training rows' bar was the data's bar)
        return _prepare_eval(ctx, tokenizer)


def _prepare_eval(ctx: BuildContext, tokenizer: Any) -> HeldOut | None:
    source, raw = heldout.load(ctx.data, ctx)
    if source is None:
        return None
    where = f"data.eval={ctx.data.eval}"
    if len(raw) == 0:
        raise DataError(f"{where}: the held-out data has no rows")
    try:
        rows, _ = source.convert(raw)
        with chat.rendering(tokenizer, ctx.data):
            ds, stats = ctx.method.prepare(rows, tokenizer, ctx)
            prompts = [_rows.sample_prompt_ids(tokenizer, rows[i], i)
                       for i in range(min(ctx.train.eval_samples, len(rows)))]
    except DataError as e:
        if e.row is None:
            raise
        raise DataError(f"{where}: {source.locate(raw, e.row)}: {e}", row=e.row) from e
    if len(ds) == 0:
        raise DataError(f"{where}: no held-out example survived preparation; check "
                        "method.max_length and the data")
    ds, stats = ctx.packing.apply(ds, stats, eval_context(ctx))
    return HeldOut(ds, stats, heldout.describe(ctx.data), prompts)


def sampler(ctx: BuildContext, tokenizer: Any, engine: Engine) -> Callable[[nn.Module, list[list[int]]], list[str]]:
    """``(policy, prompts) -> completions``: greedy completions of ``train.eval_max_new_tokens``
    tokens of left-padded ``prompts`` with ``engine``, decoded (``train.eval_samples``)."""
    def sample(policy: nn.Module, prompts: list[list[int]]) -> list[str]:
        import torch

        pad = tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        params = SamplingParams(max_new_tokens=ctx.train.eval_max_new_tokens, greedy=True,
                                eos=tokenizer.eos_token_id, pad=pad)
        samples = engine.generate(policy, ids.to(ctx.device), mask.to(ctx.device), params)
        return tokenizer.batch_decode(samples.token_ids, skip_special_tokens=True)

    return sample


def pack(ctx: BuildContext, ds: Any, stats: DataStats) -> tuple[Any, DataStats]:
    """The packing option applied to prepared rows (DataError when no example is left)."""
    ds, stats = ctx.packing.apply(ds, stats, ctx)
    if len(ds) == 0:
        skipped = (stats.extra.get("unsplittable") or {}).get("skipped")
        raise DataError(
            f"no example survived preparation ({stats.examples_dropped} dropped"
            + (f", {skipped} skipped as unsplittable by the chat template" if skipped else "")
            + "); check method.max_length and the data"
        )
    return ds, stats


def batch_stream(ctx: BuildContext, tokenizer, ds) -> BatchStream:
    """The stream of collated micro-batches the trainer receives from prepared rows ``ds``
    (this rank's slice of every global batch)."""
    collate = partial(ctx.method.collate, tokenizer=tokenizer, ctx=ctx)
    return BatchStream(ds, ctx.packing.batch_items(ctx), ctx.train.seed, collate,
                       shard=(ctx.rank, ctx.world_size))


def check_trainable(stats: DataStats) -> None:
    """DataError (status ``invalid``) when the prepared data has no token to train on, or no
    example that carries a training signal (every one hollow: ``stats.hollow_rows``)."""
    if stats.trainable_tokens == 0:
        empty = stats.extra.get("empty_completions")
        raise DataError(
            f"the data has nothing to train on: 0 trainable tokens in {stats.examples} "
            "examples" + (f" ({empty} empty completions)" if empty else "")
            + "; every completion / assistant turn / text is empty after preparation. "
            "Check the data (and method.max_length, which may cut completions away)"
        )
    if stats.hollow_rows and stats.hollow_rows >= stats.examples:
        raise DataError(
            f"the data has nothing to train on: all {stats.examples} examples are hollow "
            f"({stats.hollow_what}); the run would train without any signal. Check the data "
            "(and method.max_length / max_completion_length, which may cut the difference "
            "away)")


def note_hollow(ctx: BuildContext, stats: DataStats) -> None:
    """A warning (on stderr, and in ``stats.extra["hollow_warning"]``, the summary's
    ``data.hollow_warning``) when the share of hollow examples is above
    ``data.max_hollow_fraction`` (all hollow: :func:`check_trainable` refuses the data)."""
    hollow, n = stats.hollow_rows or 0, stats.examples
    if not hollow or not n or hollow >= n or hollow / n <= ctx.data.max_hollow_fraction:
        return
    stats.extra["hollow_warning"] = warning = (
        f"{hollow} of {n} examples ({hollow / n:.0%}) carry no training signal: "
        f"{stats.hollow_what} (above data.max_hollow_fraction={ctx.data.max_hollow_fraction:g})")
    if ctx.rank == 0:
        runlog.warn(warning)


def check_batch(ctx: BuildContext, ds: Any, stats: DataStats) -> None:
    """DataError (status ``invalid``) when the prepared rows cannot fill one micro-batch of
    ``train.batch_size`` rows on every process: every micro-batch would hold fewer rows than
    asked, so the run would measure and train another configuration than the one it records
    (two batch sizes would leave the same record). Refused rather than recorded: every reader of
    a summary (report, fit, a comparison with an estimate) takes ``train.batch_size`` as the
    micro-batch that ran."""
    world, asked = ctx.world_size, ctx.train.batch_size
    need_items = ctx.packing.batch_items(ctx) * world
    if stats.rows >= asked * world and len(ds) >= need_items:
        return
    per = f" x {world} processes" if world > 1 else ""
    fit = stats.rows // world
    fix = (f"lower train.batch_size to {fit} or less" if fit >= 1
           else f"use at most {stats.rows} processes")
    how = "after preparation and packing" if ctx.packing.packs else "after preparation"
    raise DataError(
        f"train.batch_size={asked}{per} asks for {asked * world} rows per micro-batch, but the "
        f"data has {stats.rows} rows {how} ({stats.examples} examples): every micro-batch "
        f"would hold fewer rows than asked. {fix[0].upper()}{fix[1:]}, or give more data "
        "(data.n_examples for the embedded data, data.max_examples, a larger file)")


def _concatenate(a: Any, b: Any) -> Any:
    import datasets

    return datasets.concatenate_datasets([a, b])


def with_model_overrides(ctx: BuildContext, overrides: dict[str, Any] | None):
    """``ctx`` whose model group has ``overrides`` applied (a teacher of another size / seed /
    checkpoint)."""
    if not overrides:
        return ctx
    return dataclasses.replace(ctx, model=dataclasses.replace(ctx.model, **overrides))


def enable_checkpointing(model: nn.Module, every: int = 1) -> None:
    """Non-reentrant activation checkpointing on every ``every``-th decoder layer."""
    kwargs = {"use_reentrant": False}
    base = base_model(model)
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(kwargs, every_n_layers=every)
    else:  # transformers < 5
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.config.use_cache = False


class Loader:
    """Loads the run's models (the policy, and the method's extra models as its
    :class:`memlab.method.base.ModelFactory`) and tokenizers, through the seams."""

    def __init__(self, ctx: BuildContext, tokenizer, seams: Seams):
        self.ctx, self.tok, self.seams = ctx, tokenizer, seams
        self.exact_weights = seams.exact_weights

    def model(self, ctx: BuildContext, *, trainable: bool = True, head: Head | None = None,
              peft: bool = True) -> nn.Module:
        """Model with attention + dtype at load, then PEFT (``peft``) and checkpointing when
        trainable. ``head`` defaults to the method's."""
        head = head or ctx.method.head
        with self.seams.build_context():
            model = self._build(ctx, head, trainable, peft)
        return self.seams.place_model(model) if self.seams.place_model else model

    def _build(self, ctx: BuildContext, head: Head, trainable: bool, peft: bool) -> nn.Module:
        extra = ctx.peft.load_kwargs(ctx) if peft else {}
        if self.seams.load_model is not None:
            model = self.seams.load_model(ctx, self.tok, head, extra)
        else:
            model = ctx.model.load(ctx, self.tok, head, extra)
        liger = ctx.method.as_liger()
        kernels = () if liger is None else liger.liger_model_kernels()
        if kernels:
            apply_liger(model, kernels)
        if not trainable:
            model.requires_grad_(False)
            return model.eval()
        if peft:
            model = ctx.peft.apply(model, ctx, head)
        if ctx.train.gradient_checkpointing:
            enable_checkpointing(model, ctx.train.checkpoint_every)
        return model

    def __call__(self, overrides: dict[str, Any] | None = None, *, head: Head | None = None,
                 trainable: bool = False) -> nn.Module:
        """An extra model: the run's model (or the model group with ``overrides``), frozen
        (reference, teacher) or ``trainable`` without PEFT (a PPO value model)."""
        return self.model(with_model_overrides(self.ctx, overrides), trainable=trainable,
                          head=head, peft=False)

    def tokenizer(self, overrides: dict[str, Any] | None = None) -> Any:
        """A fresh tokenizer of the model group with ``overrides``."""
        ctx = with_model_overrides(self.ctx, overrides)
        load = self.seams.load_tokenizer or ctx.model.load_tokenizer
        return load(ctx)


def build(ctx: BuildContext, seams: Seams | None = None, logger: Any = None,
          on_data: Callable[[DataStats], None] | None = None) -> Pipeline:
    """Assemble everything a training run needs, in the order documented above. ``on_data``
    is called with the prepared data's stats as soon as they exist (a run records them even
    when a later stage fails)."""
    seams = seams or Seams()
    faults.note("pipeline")  # the test suite's guard: which tests build one
    tokenizer = (seams.load_tokenizer or ctx.model.load_tokenizer)(ctx)
    ds, stats = (seams.prepare_data or prepare_data)(ctx, tokenizer)
    if ctx.rank == 0 and seams.prepare_data is None:  # (an estimate's rows are made up)
        runlog.file_only(runlog.data_line(stats.as_dict()))
    note_hollow(ctx, stats)
    if on_data is not None:
        on_data(stats)
    check_trainable(stats)
    if seams.prepare_data is None:  # the run's rows (an estimate's own are whole batches)
        check_batch(ctx, ds, stats)
    loader = Loader(ctx, tokenizer, seams)
    policy = loader.model(ctx)
    offload = ctx.offload.build(policy, ctx, seams.offload)
    policy = ctx.distributed.wrap(policy, ctx)
    # no local name keeps the extra models alive: before_training may drop one (and free it)
    extra = ctx.method.as_extra_models()
    models = {"policy": policy, **({} if extra is None else extra.extra_models(policy, ctx, loader))}
    held = (seams.prepare_eval or prepare_eval)(ctx, tokenizer)
    if held is not None and ctx.rank == 0 and seams.prepare_eval is None:
        runlog.file_only(runlog.data_line(held.stats.as_dict(), "held-out data"))
    both = ds if held is None else _concatenate(ds, held.ds)
    with seams.model_context():  # the first pass that runs the models
        prepared = None if extra is None else extra.before_training(models, both, ctx)
    if prepared is not None:  # the dataset with columns the method added (e.g. reference logps)
        if held is not None:  # the held-out rows follow the training rows
            held.ds = prepared.select(range(len(ds), len(prepared)))
            prepared = prepared.select(range(len(ds)))
        ds = prepared
    stream = batch_stream(ctx, tokenizer, ds)
    generation = None
    if ctx.method.as_generating() is not None:
        rng = seams.rng or run_rng(ctx.train.seed, ctx.rank)
        if seams.engine is not None:
            engine = seams.engine(ctx, tokenizer, policy)
            generation = GenerationEnv(engine, rng)
        else:
            generation = GenerationEnv(ctx.generation.build(ctx, tokenizer, policy), rng,
                                       local=HFEngine(ctx.distributed))
    evaluator = None
    if held is not None:
        engine = generation.engine if generation is not None else HFEngine(ctx.distributed)
        evaluator = Evaluator(
            ctx, ctx.method, held.ds, partial(ctx.method.collate, tokenizer=tokenizer, ctx=ctx),
            ctx.packing.batch_items(eval_context(ctx)), env=generation,
            sample=sampler(ctx, tokenizer, engine), prompts=held.prompts,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    trainer = Trainer(ctx, ctx.method, models, stream, logger=logger, offload=offload,
                      generation=generation, options=seams.loop, evaluator=evaluator)
    return Pipeline(tokenizer, ds, stats, models, stream, offload, generation, trainer, held)
