"""The one assembly function.

Order, and why:

1. tokenizer (model group): the data steps need it.
2. data source -> method.prepare (format, tokenize, truncate, shifted labels) -> packing.apply.
   Labels are shifted per document *before* packing, so no token is ever trained to predict
   the first token of the next document in a packed row. Truncation happens before packing
   except for strategies that keep overflow tokens themselves (bfd_split, wrapped).
3. collator: the method's, told by packing / padding_free / pad_to_multiple_of how to shape
   rows (padded with an attention mask, or flat with restarting position_ids).
4. model: attention backend and parameter dtype are chosen at load (transformers builds
   its attention modules from them; quantization too, for qlora).
5. peft: adapters on the loaded model (before checkpointing, which must see the final modules).
6. gradient checkpointing (non-reentrant, every k-th layer), then activation offload hooks:
   offload wraps the forward outside checkpointing, so only what checkpointing still saves is
   moved off the device.
7. distributed wrap last (DDP wraps the finished module; each rank runs this same build and
   streams its own slice of every global batch).
8. extra models the method needs (reference, teacher, reward, value...), built by the same
   loader (optionally with model-group overrides: a teacher of another size), then
   the method's one-off pass (``before_training``), which may return the dataset with added
   columns (DPO's precomputed reference log-probs) and drop a model it no longer needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from memlab.method.base import DataStats
from memlab.trainer.loop import BatchStream


@dataclass
class Pipeline:
    tokenizer: Any
    dataset: Any
    stats: DataStats
    models: dict[str, nn.Module]
    stream: BatchStream
    offload_handle: Any


def prepare_data(ctx, tokenizer) -> tuple[Any, DataStats]:
    """Data source -> method transforms -> packing."""
    raw = ctx.data.load(ctx)
    ds, stats = ctx.method.prepare(raw, tokenizer, ctx)
    ds, stats = ctx.packing.apply(ds, stats, ctx)
    if len(ds) == 0:
        raise ValueError(
            f"no example survived preparation ({stats.examples_dropped} dropped); "
            "check method.max_length and the data"
        )
    return ds, stats


def load_model(ctx, tokenizer, *, trainable: bool = True, head: str | None = None,
               peft: bool = True) -> nn.Module:
    """Model with attention + dtype at load, then PEFT (``peft``) and checkpointing when
    trainable. ``head`` defaults to the method's."""
    head = head or ctx.method.head
    model = ctx.model.load(ctx, tokenizer, head, ctx.peft.load_kwargs(ctx))
    if getattr(ctx.method, "use_liger_kernel", False):
        from memlab.model._liger import apply_liger

        apply_liger(model)
    if not trainable:
        model.requires_grad_(False)
        return model.eval()
    if peft:
        model = ctx.peft.apply(model, ctx, head)
    if ctx.train.gradient_checkpointing:
        enable_checkpointing(model, ctx.train.checkpoint_every)
    return model


def with_model_overrides(ctx, overrides: dict[str, Any] | None):
    """``ctx`` whose model group has ``overrides`` applied (a teacher of another size / seed /
    checkpoint); the model group may define ``with_overrides`` (estimate's stand-in does)."""
    if not overrides:
        return ctx
    import dataclasses

    m = ctx.model
    new = m.with_overrides(overrides) if hasattr(m, "with_overrides") else dataclasses.replace(
        m, **overrides)
    return dataclasses.replace(ctx, model=new)


def load_extra(ctx, tokenizer, model_overrides: dict[str, Any] | None = None, *,
               head: str | None = None, trainable: bool = False) -> nn.Module:
    """An extra model: the run's model (or the model group with ``model_overrides``), frozen
    (reference, teacher) or ``trainable`` without PEFT (a PPO value model), with ``head``."""
    return load_model(with_model_overrides(ctx, model_overrides), tokenizer,
                      trainable=trainable, head=head, peft=False)


def enable_checkpointing(model: nn.Module, every: int = 1) -> None:
    """Non-reentrant activation checkpointing on every ``every``-th decoder layer."""
    kwargs = {"use_reentrant": False}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(kwargs, every_n_layers=every)
    else:  # transformers < 5
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.config.use_cache = False


def build(ctx) -> Pipeline:
    """Assemble everything a training run needs, in the order documented above."""
    tokenizer = ctx.model.load_tokenizer(ctx)
    ds, stats = prepare_data(ctx, tokenizer)
    collate = partial(ctx.method.collate, tokenizer=tokenizer, ctx=ctx)
    policy = load_model(ctx, tokenizer)
    offload_handle = ctx.offload.build(policy, ctx)
    policy = ctx.distributed.wrap(policy, ctx)
    # no local name keeps the extra models alive: before_training may drop one (and free it)
    models = {"policy": policy, **ctx.method.extra_models(
        policy, ctx, partial(load_extra, ctx, tokenizer)
    )}
    prepared = ctx.method.before_training(models, ds, ctx)
    if prepared is not None:  # the dataset with columns the method added (e.g. reference logps)
        ds = prepared
    stream = BatchStream(ds, ctx.train.batch_size, ctx.train.seed, collate,
                         shard=(ctx.rank, ctx.world_size))
    return Pipeline(tokenizer, ds, stats, models, stream, offload_handle)
