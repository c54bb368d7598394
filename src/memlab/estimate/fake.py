"""One training step on fake tensors, through :func:`memlab.pipeline.build` with the
estimator's seams, measured by the run's own memory tracker.

Fake tensors (``FakeTensorMode``) carry shapes, dtypes and devices but no data: a 1B model costs
nothing to "allocate", every kernel is replaced by its shape function, and the tracker still
sees every storage come and go. Two steps are modelled like a real run tracked with
``measure.memory_steps=all``: the optimizer's state is created by its own first update on zero
gradients (:meth:`memlab.trainer.loop.Trainer.init_optimizer_state`), then the steady-state
step 1 runs under the tracker (``run_first_step`` tracks step 0 as well), once for every
candidate batch (:mod:`memlab.estimate.batch`: full, padded, packed... rows, or the run's own
batches with ``from_data``), each a tracked step of its own; the peak is the largest, and the
result names the batch that set it. With gradient accumulation two micro-batches are enough:
from the second on, every micro-batch repeats the same memory.

Value-dependent decisions: a forward reads a few *values* (is the padding mask all ones? is this
row packed?). Transformers treats fake inputs as tracing and always materialises a full mask.
Because the estimator built the batch itself it knows the real values: with ``exact_masks``
(default) those two decisions of transformers' mask construction are evaluated on the real
batch tensors (:func:`memlab.measure.patches.mask_decisions`), so the fake step takes the same
branches as the real one. Where memlab itself needs a value (the documents of a packed row) the
collator computed it on the host already. Other value reads are answered without values by
:func:`memlab.estimate.modes.estimate_fake_mode` and reported.

Sharded runs: ``distributed=fsdp2`` (``fully_shard``) and ``distributed=deepspeed`` (its engine,
ZeRO 0-3) run their real wrap on the fake weights over torch's fake process group
(``FakeStore``, backend ``fake``) with ``nproc`` ranks, so a rank's peak is measured (what the
wrapper needs there: its ``on_fake_group``). DDP, whose C++ reducer needs real storage, is estimated as one plain process and sharded by a
stated model (:mod:`memlab.estimate.sharding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import datasets
import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memlab.estimate import preload  # noqa: F401  (what every estimate loads, loaded up front)
from memlab.estimate.batch import (
    Candidate,
    candidates,
    describe_batch,
    describe_rows,
    distinct,
    padded,
    run_batches,
    run_micro_batches,
    trained_batch,
    worst_case_rollout_tensors,
)
from memlab.estimate.decode import ShortDecode
from memlab.estimate.measured import Measured
from memlab.estimate.modes import FlopCount, estimate_fake_mode, estimate_tracker, exact_value_hooks
from memlab.estimate.options import CUDA_BLOCK, EstimateError, EstimateOptions
from memlab.estimate.sharding import shard_units
from memlab.estimate.standins import (
    OFFLOAD,
    ModelStandin,
    NoDraw,
    QuantizedLinearStandin,
    WorstCaseEngine,
    round_trip_token,
)
from memlab.measure.data import DataStats
from memlab.method.base import LOSS_INDEX
from memlab.pipeline import HeldOut, Seams, build, eval_context
from memlab.trainer.batch import Batch
from memlab.trainer.loop import LoopOptions
from memlab.trainer.routing import unwrap

if TYPE_CHECKING:
    from memlab.context import BuildContext
    from memlab.estimate.layers import Plan


def _param_info(model: nn.Module) -> dict[str, Any]:
    total = trainable = 0
    by_dtype: dict[str, int] = {}
    quant = 0
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, QuantizedLinearStandin):
            quant += 1
            total += mod.logical_numel
            key = f"{'uint8(4-bit)' if mod.weight.dtype == torch.uint8 else 'int8'}"
            for p in mod.parameters(recurse=False):  # the weight and its quantization state
                if p is mod.bias or id(p) in seen:
                    continue
                by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
                seen.add(id(p))
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
        key = str(p.dtype).replace("torch.", "")
        by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
    out = {"total": int(total), "trainable": int(trainable), "bytes_by_dtype": by_dtype}
    if quant:
        out["quantized_linears"] = quant
    return out


def _hf_summary(cfg) -> dict[str, Any]:
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings")
    return {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}


def _fake_micro_batches(batch: Batch, micro: int, mode) -> list[Batch]:
    """``micro`` copies of ``batch`` on fake tensors, each with its own storage (a run collates
    every micro-batch of a step separately and keeps them all until the step ends)."""
    return [dataclasses.replace(batch, tensors={
        n: mode.from_tensor(v.clone()) if isinstance(v, torch.Tensor) else v
        for n, v in batch.tensors.items()}) for _ in range(micro)]


def epoch_steps(ctx: BuildContext, trainer, opts: EstimateOptions, notes: list[str]
                ) -> int | None:
    """The run's steps where this estimate knows them: ``train.steps``, or with
    ``train.epochs`` and ``--from-data`` what the passes over the run's own rows come to (a note
    says it); None where they depend on rows this estimate does not read (then a step with the
    optimizer's state is measured: the worst case of any step count)."""
    epochs = ctx.train.epochs
    if epochs is None or ctx.train.steps is not None:
        return trainer.steps
    if opts.from_data:
        notes.append(f"train.epochs={epochs}: {trainer.plan.steps_per_epoch} step(s) a pass over "
                     f"the prepared rows, {trainer.steps} in all")
        return trainer.steps
    notes.append(f"train.epochs={epochs}: its steps depend on the data's rows, which this "
                 "estimate does not read (--from-data counts them); a step with the optimizer's "
                 "state is measured, the peak of any step count")
    return None


def run_fake_step(ctx: BuildContext, opts: EstimateOptions, notes: list[str], *,
                  every_decode_step: bool = False, parallel_builds: bool = False
                  ) -> dict[str, Any]:
    """Build the configured run through :func:`memlab.pipeline.build` with the estimator's
    seams and run the tracked training step(s) through
    :meth:`memlab.trainer.loop.Trainer.run_step`, once per candidate batch
    (:mod:`memlab.estimate.batch`: the worst-case candidates, or with ``from_data`` the run's
    own micro-batches); returns the raw probe result (the largest peak of them all) plus model /
    batch descriptions. ``ctx`` is the validated context (run on the CPU here).
    ``every_decode_step``: generation runs the model for every new token instead of
    :mod:`memlab.estimate.decode`'s shortcut (the reference its tests compare with).
    With ``opts.every_layer`` off, a deep model is measured as two shallow builds extended
    exactly to its depth where :mod:`memlab.estimate.layers` can; ``parallel_builds``: the
    shallower one in a forked process meanwhile (:mod:`memlab.estimate.forked`; measured here
    after all where the child gives no result)."""
    from memlab.estimate import layers

    plan = None if opts.every_layer else layers.repeated_depth(ctx, opts)
    if plan is not None:
        full, why = layers.measure_shallow(plan, lambda n: measure(
            ctx, opts, list(notes), every_decode_step=every_decode_step, layers=n, plan=plan),
            parallel=parallel_builds)
        if full is not None:
            res = summarize(full)
            notes[:] = full.notes
            return res
        notes.append(f"every one of the model's {plan.depth} layers measured: {why}")
    return summarize(measure(ctx, opts, notes, every_decode_step=every_decode_step))


def measure(ctx: BuildContext, opts: EstimateOptions, notes: list[str], *,
            every_decode_step: bool = False, layers: int | None = None,
            plan: Plan | None = None) -> Measured:
    """The fake build and its tracked steps (:func:`run_fake_step`); ``layers``: every model
    built with that many decoder layers, the memory after every op recorded by the part of
    the model running as ``plan`` labels it (:mod:`memlab.estimate.layers`)."""
    cuda = opts.device == "cuda"
    liger = ctx.method.as_liger()
    if liger is not None and liger.uses_liger():
        raise EstimateError(
            "memlab estimate runs the training step on fake tensors, which Liger's Triton "
            "kernels cannot launch on (they need real device memory); estimate the "
            "configuration with method.use_liger_kernel=false (method.loss_impl=chunked for a "
            "fused loss that never builds the logits), and measure Liger on a GPU "
            "(benchmarks/gpu_acceptance.py --only liger)")
    mode = estimate_fake_mode()
    counter = FlopCount() if opts.count_flops else None
    steps = ShortDecode(counter, mode, every_step=every_decode_step)
    standin = ModelStandin(opts.config_overrides, notes, mode, layers=layers)
    dense_padding = True  # padded rows build a dense [rows, 1, T, T] mask (sdpa, eager)
    if not (ctx.attention.trains_on_cpu and "cpu" in ctx.attention.devices):
        from memlab.attention.sdpa import Sdpa

        ctx = dataclasses.replace(ctx, attention=Sdpa())
        dense_padding = False
        notes.append("a CUDA-only attention backend is estimated with per-document sdpa (no "
                     "[L, L] scores, per-document in packed rows, as flash attention); its "
                     "padded rows build no dense mask (flash unpads them into one varlen row, "
                     "flex builds a block mask), so sdpa runs them without one (a model: "
                     "flash's unpadded query / key / value copies stand in for the padded ones)")
    ctx = dataclasses.replace(ctx, device="cpu")
    tokenizer = standin.load_tokenizer(ctx)

    online = ctx.method.as_generating()
    length = None
    cands: list[Candidate] | None = None
    if opts.from_data:
        if opts.length:
            raise EstimateError("--length and --from-data exclude each other: --from-data "
                                "measures the run's own batches, whatever their length")
    else:
        # online: the prompts (then generation)
        length = opts.length or ctx.method.row_layout(ctx).row_length
        if length is None:
            raise EstimateError("method.max_length is null: give the row length with --length "
                                "N (or set method.max_length), or measure the real batches "
                                "with --from-data")
        cands = candidates(ctx, tokenizer, length, opts.docs_per_row)
    if online is not None:
        notes.append(f"generation: every completion runs to {online.sampling_length()} new "
                     "tokens (no early EOS), with the model's own generate (KV cache, "
                     "sampling); the training batch is the prompts x completions it makes; "
                     "reward functions and reward models score the decoded worst-case "
                     "completions")
    real: dict[str, torch.Tensor] = {}  # the values of the batch being measured (hooks read it)

    def hooks() -> contextlib.AbstractContextManager:
        return (exact_value_hooks(real, mode, dense_padding) if opts.exact_masks
                else contextlib.nullcontext())

    @contextlib.contextmanager
    def in_fake_mode() -> Iterator[None]:
        with mode, hooks():
            yield

    world = ctx.world_size
    prepare = None  # from_data: the run's own data preparation
    prepare_eval: Callable[[Any, Any], HeldOut | None] | None = None
    eval_cands: list[Candidate] = []
    if cands is not None:
        assert length is not None
        rows = [r for c in cands for r in c.rows * world]  # each rank's slice: the candidate
        prepare = lambda c, t: (datasets.Dataset.from_list(rows),  # noqa: E731
                                DataStats(rows=len(rows), examples=len(rows)))
        if ctx.data.eval is not None:  # the held-out batches: eval_batch_size rows each
            eval_cands = candidates(eval_context(ctx), tokenizer, length, opts.docs_per_row)
            eval_rows = [r for c in eval_cands for r in c.rows * world]
            prepare_eval = lambda c, t: HeldOut(  # noqa: E731
                datasets.Dataset.from_list(eval_rows),
                DataStats(rows=len(eval_rows), examples=len(eval_rows)), "worst-case rows")
        else:
            prepare_eval = lambda c, t: None  # noqa: E731
    token = round_trip_token(tokenizer)
    placed: dict[int, dict[str, Any]] = {}  # each model's weights as built, before any wrap

    def place(model: nn.Module) -> nn.Module:
        model = standin.place(model)  # (ZeRO-3 then partitions them: counted here, whole)
        placed[id(model)] = {**_param_info(model), "shard_units": shard_units(model)}
        return model

    seams = Seams(
        load_tokenizer=standin.load_tokenizer,
        load_model=standin.load,
        build_context=standin.build_context,
        place_model=place,
        prepare_data=prepare,
        offload=OFFLOAD,
        engine=lambda c, t, p: WorstCaseEngine(c.distributed, token, steps),
        rng=NoDraw(),
        exact_weights=False,
        model_context=in_fake_mode,
        prepare_eval=prepare_eval,
        loop=LoopOptions(tracker=estimate_tracker(CUDA_BLOCK if cuda else 0), grad_scaler=False,
                         foreach=True if cuda else None),
    )
    if ctx.precision.needs_scaler:
        notes.append("fp16 loss scaling (GradScaler) is left out: a few scalars")
    t0 = time.perf_counter()
    pipe = build(ctx, seams)
    build_s = time.perf_counter() - t0
    trainer, models = pipe.trainer, pipe.models
    record = None
    if layers is not None:
        from memlab.estimate.layers import LayerRecord

        assert plan is not None
        record = LayerRecord.start(models, trainer.probe.tracker, layers, standin.loaded_layers,
                                   steps, plan)
    extra = sorted(k for k in models if k != "policy")
    collate = pipe.stream.collate
    if cands is None:
        drawn = run_micro_batches(ctx, trainer.plan)
        cands = run_batches(pipe.stream, ctx, trainer.plan)
        if trainer.evaluator is not None:  # every held-out micro-batch of this rank
            ev = trainer.evaluator
            held_batches = [collate(ev.rows(idx)) for idx, _ in ev.slices()]
            eval_cands = distinct([Candidate(f"held-out batch {k}", [], describe_rows(b), batch=b)
                                   for k, b in enumerate(held_batches)], key=lambda c: c.batch)
        notes.append(f"from_data: the run's own batch stream over the prepared data (seed "
                     f"{ctx.train.seed}): every micro-batch of its {trainer.steps} step(s) "
                     f"({drawn} drawn); {len(cands)} of them measured, the others need no more "
                     "memory than one of these (same mask decisions and documents, no "
                     "dimension larger)")
    else:
        added = sorted(set(pipe.dataset.column_names) - set(rows[0]))
        if added:
            notes.append("method.before_training ran on the synthetic rows (untracked, as "
                         f"before step 0) and added {', '.join(added)}; models kept for "
                         f"training: {', '.join(sorted(models))}")
        start = 0
        for c in cands:  # the rows as the pipeline prepared them (a packed group: one item)
            n = len(c.rows)
            cols = pipe.dataset[start: start + n]
            c.rows = [{name: cols[name][i] for name in cols} for i in range(n)]
            c.batch = collate(c.rows)
            start += n * world
        cands = distinct(cands, key=lambda c: c.batch)
        start = 0
        held = pipe.held_out
        for c in eval_cands:  # the held-out rows as the pipeline prepared them
            assert held is not None
            n = len(c.rows)
            cols = held.ds[start: start + n]
            c.rows = [{name: cols[name][i] for name in cols} for i in range(n)]
            c.batch = collate(c.rows)
            start += n * world
        eval_cands = distinct(eval_cands, key=lambda c: c.batch)
        if any(LOSS_INDEX in c.collated().tensors for c in cands):
            notes.append("the output head runs at the labelled positions of the generated rows "
                         "(method.head_on=labelled: every real token for SFT, the completions "
                         "for preference pairs); a run whose data labels fewer, such as "
                         "completion-only chat or shorter answers, needs less; --from-data "
                         "measures its own batches")
    micro = min(max(1, ctx.train.grad_accum), 2)
    if ctx.train.grad_accum > 2:
        notes.append(f"grad_accum={ctx.train.grad_accum} estimated with 2 micro-batches per "
                     "step (from the second on, every micro-batch repeats the same memory)")
    elif opts.from_data and micro > 1:
        notes.append("from_data: each batch is measured as every micro-batch of its step (the "
                     "second has the gradients of the first alive: the worst place it can take)")
    for m in models.values():
        m.train(m is trainer.policy)

    # a wrapper that owns the step (DeepSpeed's engine) makes its state, buffers and ZeRO-3's
    # module trace in its own step 0, and links its state into its buffers (no clearing it to
    # replay a step 0): its step 0 runs once, the first batch's; later batches continue the run
    owned = ctx.distributed.as_step_owner() is not None
    run_len = epoch_steps(ctx, trainer, opts, notes)
    if run_len == 1:  # the run's only step: no optimizer state before its update
        run_steps = [0]
    else:
        run_steps = [0, 1] if opts.run_first_step or owned else [1]
    if owned and run_len == 1 and len(cands) > 1:
        notes.append("train.steps=1: batches after the first are measured as later steps of "
                     f"{ctx.distributed.name}'s engine, with its optimizer state (an upper bound)")
    eval_phase: list[int] = []
    ran: list[tuple[int, int]] = []  # (candidate, run step) of each tracked step
    trained: list[dict] = []  # each candidate's trained batch (online: its rollout)
    t1 = time.perf_counter()
    try:
        with in_fake_mode(), counter if counter is not None else contextlib.nullcontext():
            if run_steps == [1]:  # step 0's optimizer update, by the optimizer: its state
                trainer.init_optimizer_state()
            for k, c in enumerate(cands):
                with unset_fake_temporarily():  # made here, freed after: one batch alive
                    real.clear()
                    real.update({n: v for n, v in c.collated().tensors.items()
                                 if isinstance(v, torch.Tensor)})
                    if online is not None:
                        real.update(worst_case_rollout_tensors(online, c.collated(), token, ctx))
                    batches = _fake_micro_batches(c.collated(), micro, mode)
                for step in (run_steps if not (owned and k) else [max(run_steps[-1], 1)]):
                    if step == 0:  # this candidate as the run's first step: no state yet
                        trainer.opt.state.clear()
                    trainer.step_idx = len(ran)
                    ran.append((k, step))
                    step_batches = list(batches)  # an online method's rollouts replace them
                    trainer.run_step(step_batches, tracked=True)
                trained.append(trained_batch(step_batches[0]))  # no tensor outlives its step
                del batches, step_batches
            for c in eval_cands:  # after the steps: the optimizer's state exists, no gradient
                held_batch, evaluator = c.batch, trainer.evaluator
                assert held_batch is not None and evaluator is not None
                with unset_fake_temporarily():
                    real.clear()
                    real.update({n: v for n, v in held_batch.tensors.items()
                                 if isinstance(v, torch.Tensor)})
                    batch = _fake_micro_batches(held_batch, 1, mode)[0]
                trainer.step_idx = len(ran)
                evaluator.measure(trainer, batch)
                c.peak = trainer.probe.last_phase_peak
                eval_phase.append(len(record.log) - 1 if record is not None else -1)
                del batch
    except (torch._subclasses.fake_tensor.DataDependentOutputException,
            torch._subclasses.fake_tensor.DynamicOutputShapeException) as e:
        raise EstimateError(
            f"the training step reads tensor values ({e}); the estimator answers only the "
            "value-dependent decisions it knows (transformers' mask decisions): a new one needs "
            "its value computed on the host (like the rows' document segments) or an answer "
            "in memlab.estimate.fake") from e
    finally:
        if record is not None:  # its hooks and patches end with the steps, whatever happens
            record.stop()
    step_s = time.perf_counter() - t1
    policy = unwrap(trainer.policy)
    return Measured(
        ctx=ctx, notes=notes, probe=trainer.probe, ran=ran, run_steps=run_steps, cands=cands,
        eval_cands=eval_cands, eval_phase=eval_phase, trained=trained, length=length,
        micro=micro,
        model={**placed[id(policy)], "config": _hf_summary(standin.config(ctx.model, tokenizer)),
               "extra_models": extra, "models_in_training": sorted(models)},
        flops=None if counter is None else counter.total, assumed=dict(mode.assumed),
        decode_skipped=bool(steps.skipped),
        offload=pipe.offload.stats() if pipe.offload is not None else None,
        timing={"build_s": build_s, "steps_s": step_s}, layers=record)


def summarize(m: Measured) -> dict[str, Any]:
    """The raw probe result, the notes and the model / batch descriptions of what
    :func:`measure` measured (:func:`run_fake_step`'s result)."""
    ctx, notes, cands, eval_cands, ran = m.ctx, m.notes, m.cands, m.eval_cands, m.ran
    trained, run_steps, micro = m.trained, m.run_steps, m.micro
    online = ctx.method.as_generating()
    if m.decode_skipped and online is not None:
        notes.append(f"generation: decode steps 2 to {online.sampling_length() - 2} of each "
                     "generate call answered without running the model (every step between "
                     "the first and the last runs the same ops on a shorter cache); the cache "
                     "grown to its full length before the last step; FLOPs and value reads of "
                     "the skipped steps counted from the first and the last "
                     "(memlab.estimate.decode)")
    if m.assumed:
        notes.append("value reads answered without values (metrics, logging): " + ", ".join(
            f"{n} {k}" for k, n in sorted(m.assumed.items())))
    raw = m.probe.result()
    peaks = [0] * len(cands)
    for i, (k, _) in enumerate(ran):
        peaks[k] = max(peaks[k], m.probe.step_peaks.get(i, 0))
    at = raw.get("peak_at") or {}
    if at.get("phase") == "eval":  # a held-out batch set the peak
        top, top_step = max(range(len(cands)), key=peaks.__getitem__), run_steps[-1]
        raw["peak_at"] = {**at, "step": top_step, "batch": "held-out " + max(
            eval_cands, key=lambda c: c.peak).name}
    else:
        top, top_step = ran[at["step"]] if at else (0, run_steps[-1])
        raw["peak_at"] = {**at, "step": top_step, "batch": cands[top].name}
    if eval_cands:
        notes.append(f"eval: {len(eval_cands)} held-out batch(es) of train.eval_batch_size="
                     f"{ctx.train.eval_rows()} rows measured after the steps, without "
                     "gradients (the optimizer's state alive): " + "; ".join(
                         f"{c.name} ({c.description}): "
                         f"{c.peak / 2**20:.2f} MiB" for c in eval_cands)
                     + (" (eval samples' generation is not modelled)"
                        if ctx.train.eval_samples else ""))
    if len(cands) > 1:
        notes.append("batches measured: " + "; ".join(
            f"{c.name} ({c.description}): {peaks[k] / 2**20:.2f} MiB"
            for k, c in enumerate(cands)) + f"; the peak is the {cands[top].name} batch's")
    return {
        "raw": raw,
        "offload": m.offload,
        "model": m.model,
        "batch": {**describe_batch(trained[top], ctx, cands[top].description, m.length,
                                   padded(cands[top].collated().tensors)),
                  "peak_from": cands[top].name,
                  "candidates": [{"name": c.name, "rows": c.description, "peak_bytes": peaks[k],
                                  "shapes": trained[k]["shapes"],
                                  "padded": padded(c.collated().tensors)}
                                 for k, c in enumerate(cands)],
                  "micro_batches_per_step": micro, "grad_accum": ctx.train.grad_accum},
        "flops": None if m.flops is None else {
            "total": m.flops, "micro_batches": len(ran) * micro,
            "per_micro_batch": m.flops // max(1, len(ran) * micro),
            "per_step": m.flops // max(1, len(ran) * micro) * max(1, ctx.train.grad_accum)},
        "timing": {**m.timing, "steps": sorted({s for _, s in ran}), "batches": len(cands)},
    }
