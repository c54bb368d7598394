"""``memlab estimate``: predict the peak memory of a configuration without running it.

How (and why this is not a formula): the estimate builds the configured run through the same
:func:`memlab.pipeline.build` a run uses - data transforms, collator, model with attention +
dtype, PEFT, checkpointing, offload hooks, the distributed wrap, the method's extra models and
one-off pass, the trainer - with explicit seams where an estimate must differ (fake weights
built from the model's config, the worst-case batches, generation to the full length, a fake
process group), then runs :meth:`memlab.trainer.loop.Trainer.run_step` on fake tensors under the
run's own memory tracker, once per candidate batch (rows of full length, padded rows - which
take the padding-mask path a run takes -, packed rows of 1 or 2 documents...; or, with
``--from-data``, the run's own batches), and reports the largest peak and the batch that set
it. A technique changes the estimate exactly as it changes a run, because it *is* the run's
code. The result has the categories (parameters, gradients, optimizer,
activations, other) and per-phase peaks of ``summary.json``'s ``memory`` section.

Modules: :mod:`~memlab.estimate.options` (what is asked, cards, verdict),
:mod:`~memlab.estimate.standins` (the seams' stand-ins), :mod:`~memlab.estimate.batch` (the
batches measured), :mod:`~memlab.estimate.fake` (the fake-tensor steps),
:mod:`~memlab.estimate.sharding` (what is modelled rather than measured); the table and the CLI
are in :mod:`memlab.cli.estimate`.

Devices: torch's CPU build has no fake CUDA tensors, so the step runs CPU kernels' shape
functions (e.g. CPU sdpa = flash-attention-style, no [L, L] scores). ``device='cuda'`` is a
*model*, not a measurement: every tracked allocation is rounded up to 512 bytes (the CUDA caching
allocator's block size), the cuBLAS workspace is added to "other", AdamW runs its foreach
implementation (CUDA's default), CUDA-only attention backends run as sdpa, QLoRA's packed
4/8-bit base weights are computed analytically, and the configuration is validated as a run on a
CUDA machine (:meth:`memlab.config.Platform.cuda_machine`). The CUDA context and allocator
fragmentation are not in the peak; the verdict counts the context separately.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
from collections.abc import Iterator
from typing import Any

import torch

from memlab.context import BuildContext, validate_for
from memlab.data.base import DataError
from memlab.distributed.base import Sharding
from memlab.distributed.single import Single
from memlab.estimate import bounds, modes
from memlab.estimate.fake import run_fake_step
from memlab.estimate.forked import frozen_heap
from memlab.estimate.options import (
    ALL_PHASES,
    CARDS,
    CUDA_BLOCK,
    CUDA_CONTEXT_BYTES,
    PHASES,
    EstimateError,
    EstimateOptions,
    MiB,
    cublas_workspace_bytes,
    fmt_bytes,
    local_sm_major,
    parse_bytes,
    verdict,
    zero_stage,
)
from memlab.estimate.sharding import apply_sharding
from memlab.model._files import ModelFilesError
from memlab.registry import ConfigErrors

__all__ = ["ALL_PHASES", "CARDS", "PHASES", "EstimateError", "EstimateOptions", "estimate",
           "fmt_bytes", "parse_bytes", "validate_for", "verdict"]


def _add_engine(mem: dict[str, Any], eng) -> dict[str, Any]:
    """``mem`` with a generation engine's memory (:class:`memlab.generation.base.EngineMemory`)
    as its own category, ``generation_engine``: in every phase, or only in the generate phase
    when the engine sleeps through training; the peak is the largest phase again."""
    phc, by_phase = {}, {}
    for ph, v in mem["by_phase"].items():
        add = eng.total_bytes if (ph == "generate" or not eng.released_in_training) else 0
        phc[ph] = {**(mem.get("by_phase_category") or {}).get(ph, {}), "generation_engine": add}
        by_phase[ph] = v + add
    top = max(by_phase, key=by_phase.__getitem__)
    return {**mem, "by_phase": by_phase, "by_phase_category": phc, "peak_bytes": by_phase[top],
            "by_category": phc[top], "peak_at": {**(mem.get("peak_at") or {}), "phase": top}}


def _policy_dtype(model_info: dict[str, Any]) -> torch.dtype:
    """The dtype holding most of the policy's parameter bytes."""
    by = {k: v for k, v in model_info.get("bytes_by_dtype", {}).items()
          if k in ("float32", "bfloat16", "float16")}
    return getattr(torch, max(by, key=by.__getitem__)) if by else torch.float32


def _add_other(mem: dict[str, Any], nbytes: int) -> dict[str, Any]:
    out = dict(mem)
    out["by_category"] = {**mem["by_category"], "other": mem["by_category"]["other"] + nbytes}
    out["by_phase_category"] = {ph: {**s, "other": s.get("other", 0) + nbytes}
                                for ph, s in (mem.get("by_phase_category") or {}).items()}
    out["by_phase"] = {ph: v + nbytes for ph, v in mem["by_phase"].items()}
    out["peak_bytes"] = mem["peak_bytes"] + nbytes
    return out


@contextlib.contextmanager
def _fake_rank(ctx: BuildContext, world: int, notes: list[str]) -> Iterator[None]:
    """Rank 0 of torch's fake process group (``FakeStore``, backend ``fake``) of ``world`` ranks
    for the block (collectives move no data; shapes are right), with what the run's wrapper
    needs there (its ``on_fake_group``, whose assumptions join ``notes``)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise EstimateError("memlab estimate needs its own (fake) process group, and one is "
                            "already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with ctx.distributed.on_fake_group(ctx) as assumed:
            notes.extend(assumed)
            yield
    finally:
        if dist.is_initialized():  # (the wrapper's teardown may have destroyed it)
            dist.destroy_process_group()


def _distributed_plan(ctx: BuildContext, opts: EstimateOptions, notes: list[str]
                      ) -> tuple[BuildContext, EstimateOptions, Sharding | None, int]:
    """How the run's distributed option is estimated: ``(ctx, opts, the sharding modelled or
    None, ranks of the fake process group or 0)``. A wrapper that runs on fake tensors (FSDP2,
    DeepSpeed) keeps its ranks and is measured as rank 0 of a fake process group; DDP runs as
    one plain process and is sharded by :func:`memlab.estimate.sharding.apply_sharding` (a
    model, from what the option declares: :meth:`~memlab.distributed.base.Distributed.sharding`);
    a single process with ``--world-size N --zero-stage S`` likewise."""
    wrapper, procs = ctx.distributed, ctx.world_size
    world = opts.world_size if opts.world_size > 1 else procs
    declared = wrapper.sharding()
    if declared is None:  # one plain process; --world-size N --zero-stage S models its ranks
        return ctx, opts, (Sharding() if opts.world_size > 1 else None), 0
    stage = zero_stage(declared.zero_stage)
    if opts.zero_stage and opts.zero_stage != stage:
        raise EstimateError(f"--zero-stage {opts.zero_stage} disagrees with the run's "
                            f"distributed={wrapper.name} (ZeRO stage {stage}); leave it out")
    opts = dataclasses.replace(opts, world_size=world, zero_stage=stage)
    if wrapper.wraps_fake_tensors:  # its real wrap, on a fake process group of `world` ranks
        notes.append(f"distributed={wrapper.name}: rank 0 of {world} measured: the real wrap on "
                     "the fake weights over torch's fake process group (collectives move no "
                     "data; each rank's memory is the same), train.batch_size rows per rank"
                     + ("; its engine's own step 0 runs first, once (its optimizer state, "
                        "buffers and traces), as in a run"
                        if wrapper.as_step_owner() is not None else ""))
        return dataclasses.replace(ctx, world_size=world, rank=0), opts, None, world
    notes.append(f"distributed={wrapper.name}: one rank of {world}, estimated as one plain "
                 f"process (its wrapper needs real storage) and sharded by the model below; "
                 "train.batch_size rows per rank")
    # (the method's choices that depend on the distributed option stay the run's: pinned)
    pinnable = ctx.method.as_pinnable()
    method = ctx.method if pinnable is None else pinnable.pinned(ctx)
    return (dataclasses.replace(ctx, method=method, distributed=Single(),
                                world_size=1, rank=0), opts,
            declared, 0)


def estimate(cfg, opts: EstimateOptions | None = None, choices: dict[str, str] | None = None,
             overrides: list[str] | None = None, *,
             every_decode_step: bool = False, parallel_builds: bool = False,
             stop_above: int | None = None) -> dict[str, Any]:
    """Estimate one composed configuration; returns the ``estimate.json`` dict (``status`` ok /
    invalid / failed, ``error`` says why). ``every_decode_step``: online methods generate with
    one fake forward per new token (:mod:`memlab.estimate.decode`'s reference) instead of the
    shortened decode. ``parallel_builds``: a deep model's two shallow builds
    (:mod:`memlab.estimate.layers`) run at once, the shallower in a forked process (the same
    estimate; ``memlab estimate`` does, ``memlab fit``'s estimates are parallel already).
    ``stop_above``: the most memory (``needed_bytes``: the peak, the cuBLAS workspace on CUDA,
    the CUDA context with a card) worth estimating; once a tracked moment shows the need must
    be larger, the estimate stops with ``status`` ``over_budget`` and the need it had reached,
    ``needed_at_least_bytes`` (:class:`memlab.estimate.modes.Stop`: a lower bound; not where the
    run's sharding is modelled after the step, which lowers the peak)."""
    opts = opts or EstimateOptions()
    t0 = time.perf_counter()
    notes: list[str] = []
    out: dict[str, Any] = {
        "kind": "estimate", "status": "failed", "error": None,
        "choices": dict(choices or {}), "overrides": list(overrides or []),
        "options": {k: v for k, v in dataclasses.asdict(opts).items()},
    }
    if opts.card is not None and opts.card not in CARDS:
        out["status"] = "invalid"
        out["error"] = f"unknown card {opts.card!r}; choose one of: {', '.join(CARDS)}"
        return out
    try:
        ctx = validate_for(cfg, opts.device, choices)
    except ConfigErrors as e:
        out["status"] = "invalid"
        out["error"] = str(e)
        if opts.device == "cpu":
            try:
                validate_for(cfg, "cuda", choices)
                out["error"] += ("\n(valid as a CUDA run: estimate it with --device cuda or "
                                 "--card NAME)")
            except ConfigErrors:
                pass
        return out
    ctx, opts, modelled, fake_world = _distributed_plan(ctx, opts, notes)
    out["options"]["world_size"] = opts.world_size
    out["options"]["zero_stage"] = opts.zero_stage
    sm = CARDS[opts.card]["sm"] if opts.card else local_sm_major()
    ws = cublas_workspace_bytes(sm) if opts.device == "cuda" else 0
    context = CUDA_CONTEXT_BYTES if opts.card else 0
    stop = (modes.Stop(stop_above - ws - context)
            if stop_above is not None and modelled is None else None)
    try:
        with (frozen_heap(),
              _fake_rank(ctx, fake_world, notes) if fake_world else contextlib.nullcontext()):
            why = bounds.refusal(ctx, opts, lambda c, o: bounds.peak_of(run_fake_step(
                c, o, list(notes), every_decode_step=every_decode_step)))
            if why is not None:  # too large to build: refused before any row exists
                out["status"] = "invalid"
                out["error"] = why
                return out
            with modes.stopping(stop):
                res = run_fake_step(ctx, opts, notes, every_decode_step=every_decode_step,
                                    parallel_builds=parallel_builds)
    except EstimateError as e:
        out["error"] = str(e)
        return out
    except (DataError, ModelFilesError) as e:  # --from-data: the run's data cannot make its
        out["status"] = "invalid"  # batches (a run's too); a teacher's or reward model's files
        out["error"] = str(e)  # cannot be found (the policy's are resolved by the CLI first)
        return out
    except BaseException as e:  # (raised inside the tracker: autograd may re-raise it as its own)
        if stop is None or stop.hit is None:
            raise
        need = stop.hit + ws + context
        out["status"] = "over_budget"
        out["needed_at_least_bytes"] = need
        out["error"] = (f"stopped: a tracked moment needs {fmt_bytes(need)}, more than "
                        f"{fmt_bytes(stop_above)} ({type(e).__name__})")
        out["estimator"] = {"wall_s": time.perf_counter() - t0}
        return out
    raw = res["raw"]
    mem = {k: raw[k] for k in ("peak_bytes", "by_category", "by_phase", "by_phase_category",
                                "peak_at")}
    ran, n = res["timing"]["steps"], res["timing"]["batches"]
    notes.insert(0, "measured: training step(s) " + ", ".join(map(str, ran)) + " on fake tensors "
                    "under the run's memory tracker (CPU kernels' shapes)"
                    + (f", once per batch ({n}; the peak is the largest)" if n > 1 else "")
                    + ("; optimizer state created by the optimizer's own step 0 update"
                       if ran == [1] else ""))
    unsharded = mem
    if opts.device == "cuda":
        mem = _add_other(mem, ws)
        notes.append(f"device=cuda is a model: each allocation rounded up to {CUDA_BLOCK} B, "
                     f"cuBLAS workspaces {fmt_bytes(ws)} in other (forward's and backward's threads), AdamW foreach; allocator "
                     "fragmentation (reserved > allocated) is not included")
    else:
        notes.append("device=cpu: byte-exact for a CPU run of the same shapes")
    if modelled is not None:  # sharding this estimate models instead of measuring
        mem = apply_sharding(mem, opts.world_size, opts.zero_stage, res["model"]["shard_units"],
                             notes, bucket_view=modelled.gradient_as_bucket_view)
    budget = opts.budget_bytes
    overhead = 0
    if opts.card:
        budget = budget if budget is not None else CARDS[opts.card]["mib"] * MiB
        overhead = CUDA_CONTEXT_BYTES
        notes.append(f"verdict counts ~{fmt_bytes(CUDA_CONTEXT_BYTES)} of CUDA context outside "
                     "the allocator")
    info = res["model"]
    engine_base = info["total"] - (info["trainable"] if ctx.peft.has_adapter() else 0)
    device_bytes = budget if opts.device == "cuda" else None
    engine = ctx.generation.engine_memory(ctx, engine_base, _policy_dtype(info), device_bytes)
    if engine is not None:
        mem = _add_engine(mem, engine)
        notes.append(engine.note)
    offload = res["offload"]
    if offload is not None:
        notes.append(f"activation offload: {fmt_bytes(offload.get('offloaded_bytes', 0))} moved "
                     "to host memory per step (not in the device peak)")
    out.update({
        "status": "ok",
        "device": opts.device,
        "source": "estimate",
        **mem,
        "unsharded": unsharded if opts.world_size > 1 else None,
        "verdict": verdict(mem["peak_bytes"], budget, mem["by_category"], overhead),
        "card": {"key": opts.card, **CARDS[opts.card]} if opts.card else None,
        "sharding": {"world_size": opts.world_size, "zero_stage": opts.zero_stage},
        "model": res["model"],
        "batch": res["batch"],
        "offload": ({"host_peak_bytes": offload.get("peak_host_bytes"),
                     "offloaded_bytes": offload.get("offloaded_bytes"), "stats": offload}
                    if offload is not None else None),
        "flops": res["flops"],
        "generation_engine": None if engine is None else {
            "weights_bytes": engine.weights_bytes, "kv_cache_bytes": engine.kv_cache_bytes,
            "released_in_training": engine.released_in_training},
        "assumptions": notes,
    })
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["estimator"] = {**res["timing"], "wall_s": time.perf_counter() - t0,
                        "max_rss_bytes": int(usage.ru_maxrss) * 1024}
    return out


