"""A readable training loop: deterministic batches, gradient accumulation normalised over the
whole step, autocast / loss scaling, activation offload, online generation, per-phase memory,
throughput, progress bar, logging, resumable checkpoints.

One optimizer step = ``grad_accum`` micro-batches. The micro-batches of a step are collated
first so that (a) the loss is divided by the number of loss items of the *whole* step (then
1x8 and 8x1 give the same gradient) and (b) the probe knows the step's batch shapes before it
decides whether to run the step under the memory tracker.

The loop talks to the run's options through what they declare: the method (``loss``; an
online method, ``as_generating()``, its ``rollout`` and ``num_iterations``), the distributed
option (``sync``, ``all_reduce_sum``, ``memory_roles``; a wrapper that owns the step,
``as_step_owner()``, its ``optimizer`` / ``backward`` / ``step``), the precision (autocast,
loss scaler) and the offload handle. What
differs between a real run and ``memlab estimate`` comes in as :class:`LoopOptions`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memlab import faults
from memlab.measure import runlog
from memlab.measure.memory import MemoryProbe
from memlab.measure.outcome import NonFiniteLoss
from memlab.measure.profile import phase_label, profiled
from memlab.trainer import checkpoint, epochs, optim
from memlab.trainer.batch import Batch, BatchStream
from memlab.trainer.evaluate import Evaluator
from memlab.trainer.optim import build_scheduler, step_in_backward
from memlab.trainer.result import TrainResult

if TYPE_CHECKING:
    from memlab.protocols import BuildContext, GenerationEnv, LoggerRun, Method, OffloadHandle


def _scalar(x: Any) -> float:
    """``float(x)`` of a metric (a DTensor, e.g. FSDP2's gradient norm, is gathered first)."""
    if isinstance(x, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):
            x = x.full_tensor()
    return float(x)


@dataclass
class LoopOptions:
    """What a caller other than a training run changes in the loop (``memlab estimate``)."""

    tracker: Any = None
    """The memory tracker the probe runs tracked steps under (None: the run's own)."""
    grad_scaler: bool = True
    """Use the precision's loss scaler when it has one (fp16)."""
    foreach: bool | None = None
    """The optimizer's multi-tensor implementation (None: torch's default for the device)."""


class Trainer:
    """Runs ``plan.steps`` optimizer steps of ``method`` on ``models['policy']``:
    ``train.steps``, or what ``train.epochs`` comes to over ``stream``'s rows
    (:mod:`memlab.trainer.epochs`).

    ``offload``: the offload option's handle (None: nothing offloaded); ``generation``: the
    run's generation environment (engine, random draws) for online methods."""

    def __init__(self, ctx: BuildContext, method: Method, models: dict[str, nn.Module],
                 stream: BatchStream, *, logger: LoggerRun | None = None,
                 offload: OffloadHandle | None = None, generation: GenerationEnv | None = None,
                 options: LoopOptions | None = None, evaluator: Evaluator | None = None):
        options = options or LoopOptions()
        self.ctx, self.method, self.models, self.stream = ctx, method, models, stream
        self.logger = logger
        self.evaluator = evaluator
        """Evaluates on the held-out data (``data.eval``; :mod:`memlab.trainer.evaluate`)."""
        self.offload = offload
        self.generation = generation
        self.online = method.as_generating()
        """The method as an online one (None: it trains on its dataset)."""
        if self.online is not None and generation is None:
            raise ValueError(f"method={method.name} samples its batches: the trainer needs a "
                             "generation environment")
        self.policy = models["policy"]
        self.dist = ctx.distributed
        self.step_owner = self.dist.as_step_owner()
        """The wrapper that owns backward and the optimizer step (None: the trainer does)."""
        # the policy's trainable parameters, then any other model's (a PPO value model)
        seen: set[int] = set()
        self.params = []
        for m in models.values():
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
        if not any(p.requires_grad for p in self.policy.parameters()):
            raise ValueError("the policy has no trainable parameters")
        self.scaler: torch.amp.GradScaler | None = None
        self.opt: torch.optim.Optimizer
        if self.step_owner is not None:
            # a wrapper that owns backward and the optimizer step (DeepSpeed's engine) built
            # the optimizer; memlab's schedule drives the torch optimizer inside it
            self.opt = self.step_owner.optimizer(self.policy)
        else:
            self.opt = ctx.optimizer.build(self.params, ctx, self.policy, foreach=options.foreach)
            self.scaler = ctx.precision.grad_scaler(ctx.device) if options.grad_scaler else None
        self.in_backward = self.step_owner is None and ctx.optimizer.in_backward
        """Each parameter is stepped in backward (``optimizer.in_backward``): the optimizer
        phase only moves the schedule on."""
        if self.in_backward:
            self._hooks = step_in_backward(self.opt, self.params)
        self.plan = epochs.plan(ctx, stream)
        """The steps to run (``train.steps``, or ``train.epochs`` counted on the rows)."""
        self.steps = self.plan.steps
        self.sched = build_scheduler(self.opt, ctx.train, self.steps)
        self.step_idx = 0
        self.result = TrainResult()
        self.probe = MemoryProbe(ctx.device, enabled=ctx.measure.memory,
                                 tracker=options.tracker)
        self.probe.watch(*models.values(), self.opt)
        self.probe.roles = lambda: self.dist.memory_roles(self.policy)
        self._max_key: tuple[int, ...] = ()
        self._rollouts: list[Batch] | None = None
        self._profiling = False  # this step runs under measure.profile_step's profiler
        self.saved_step: int | None = None
        """The step of the last checkpoint this run wrote."""

    # ---------------------------------------------------------------- one step
    def _tracked(self, step: int, key: tuple[int, ...]) -> bool:
        measure = self.ctx.measure
        if measure.always_tracks(step):
            return True
        if measure.memory_steps != "auto":
            return False
        return not self._max_key or any(k > m for k, m in zip(key, self._max_key, strict=False))

    def init_optimizer_state(self) -> None:
        """Create the optimizer's state as its first update does (on zero gradients), without a
        forward or backward: what ``memlab estimate`` measures step 1 against."""
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def run_step(self, batches: list[Batch], tracked: bool,
                 reuse: bool = False) -> dict[str, float]:
        """[generate,] forward + backward over the micro-batches, then one optimizer step. An
        online method's ``rollout`` replaces each prompt batch in ``batches`` by its generated
        training batch (so the caller counts the tokens actually trained on); with ``reuse``
        the batches are the last rollouts, trained on again (``method.num_iterations``)."""
        ctx, device = self.ctx, self.ctx.device
        world = ctx.world_size
        inputs = [t for b in batches for t in b.tensor_list()]
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        loss_total = 0.0
        sync_s = None
        with self.probe.step(self.step_idx, tracked, inputs):
            online, env = self.online, self.generation
            if online is not None and env is not None and not reuse:  # generate the batches
                with self._phase("generate"):
                    with self.dist.generation(self.policy):  # ZeRO-3 / FSDP2: whole weights
                        sync_s = env.sync(self.policy)
                    with ctx.precision.autocast(device):
                        batches[:] = [online.rollout(self.models, b, ctx, env)
                                      for b in batches]
                self._rollouts = list(batches)
                for b in batches:  # counted once per rollout (not again when trained again)
                    for k, v in (b.meta.get("counts") or {}).items():
                        counts[k] = counts.get(k, 0) + int(v)
            total_items: float = sum(b.num_items for b in batches)
            if world > 1:  # normalise by the items of the whole step on every rank
                total_items = self.dist.all_reduce_sum([total_items], device)[0]
            # DDP averages gradients over ranks; scaling by the world size makes that average
            # the gradient of (sum of every rank's loss) / (all items): N ranks x B == 1 x N*B
            scale = world / max(1, total_items)
            for i, b in enumerate(batches):
                with self.dist.sync(self.policy, last=i == len(batches) - 1):
                    with self._phase("forward"):
                        with ctx.precision.autocast(device), self._offload_ctx():
                            loss_sum, metrics = self.method.loss(self.models, b, ctx)
                        loss = loss_sum * scale
                    with self._phase("backward"):
                        if self.step_owner is not None:
                            self.step_owner.backward(self.policy, loss)
                        else:
                            (self.scaler.scale(loss) if self.scaler else loss).backward()
                del loss_sum
                self.probe.micro_end()
                loss_total += _scalar(loss.detach()) / world
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + _scalar(v) * b.num_items
                del loss
                if self.offload is not None:
                    self.offload.reset()
            with self._phase("optimizer"):
                gnorm = self._optimizer_step()
            if self.generation is not None:
                self.generation.weights_changed()
        if world > 1:  # the step's loss and metrics over every rank's items
            keys, ckeys = sorted(sums), sorted(counts)
            reduced = self.dist.all_reduce_sum(
                [loss_total, *(sums[k] for k in keys), *(counts[k] for k in ckeys)], device)
            loss_total, sums = reduced[0], dict(zip(keys, reduced[1:1 + len(keys)], strict=True))
            counts = {k: int(v) for k, v in zip(ckeys, reduced[1 + len(keys):], strict=True)}
        for k, v in counts.items():
            self.result.counts[k] = self.result.counts.get(k, 0) + v
        out = {"train/loss": loss_total, "train/lr": float(self.sched.get_last_lr()[0])}
        if gnorm is not None:
            out["train/grad_norm"] = gnorm
        for k, v in sums.items():
            out[k] = v / max(1, total_items)
        if sync_s is not None:  # this rank's time to push the weights to the generation engine
            out["generation/weight_sync_s"] = sync_s
        return out

    def _optimizer_step(self) -> float | None:
        """Unscale, clip, step, schedule, zero the gradients; the gradient norm before clipping
        (None without ``train.max_grad_norm``)."""
        max_norm = self.ctx.train.max_grad_norm
        if self.step_owner is not None:  # it reduces at the boundary, clips, steps, zeroes
            norm = self.step_owner.step(self.policy)
            self.sched.step()
            return None if max_norm is None else norm
        if self.in_backward:  # every parameter was stepped in backward; no clipping, no scaler
            self.sched.step()
            return None
        if self.scaler:
            self.scaler.unscale_(self.opt)
        gnorm = None
        if max_norm is not None:
            gnorm = _scalar(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            optim.step(self.opt)
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return gnorm

    def _offload_ctx(self):
        return self.ctx.offload.forward_context(self.offload)

    @contextlib.contextmanager
    def _phase(self, name: str):
        """A phase of the step: the probe's memory phase, and its label while profiled."""
        with self.probe.phase(name), phase_label(name, self._profiling):
            yield

    def _profile(self) -> contextlib.AbstractContextManager[dict[str, Any] | None]:
        """torch.profiler around this step when it is ``measure.profile_step`` (its trace and
        tables under ``<run dir>/profile``, a rank's own ``profile_rank<r>`` beside rank 0's)."""
        if not self._profiling:
            return contextlib.nullcontext(None)
        rank = self.ctx.rank
        out = Path(self.ctx.run_dir) / ("profile" if rank == 0 else f"profile_rank{rank}")
        return profiled(out, cuda=self.probe.is_cuda)

    # ---------------------------------------------------------------- the loop
    def train(self) -> TrainResult:
        ctx, res = self.ctx, self.result
        if ctx.train.resume_from:
            checkpoint.load(self, checkpoint.resolve(ctx.run_dir, ctx.train.resume_from))
        for m in self.models.values():
            m.train(m is self.policy)
        if self.generation is not None:  # an engine's own memory stays out of the tracker
            with self.dist.generation(self.policy):
                self.generation.start(self.policy, self.probe.untracked)
        bar = self._progress()
        try:
            self._loop(bar)
        finally:  # the bar's line ends before anything else is said (a stop, an error)
            if bar is not None:
                bar.close()
        if res.timed_steps == 0:
            res.throughput_note = (
                "every step was warm-up or ran under the memory tracker; raise train.steps or "
                "set measure.memory_steps=2 for a throughput number")
        return res

    def _loop(self, bar) -> None:
        ctx, res = self.ctx, self.result
        every = self.online.num_iterations if self.online is not None else 1
        self._rollouts = None
        while self.step_idx < self.steps:
            # online methods with num_iterations > 1 generate on every num_iterations-th step
            # and train on those rollouts again in between (no new prompts drawn)
            rollouts = self._rollouts if every > 1 and self.step_idx % every != 0 else None
            reuse = rollouts is not None
            if rollouts is not None:
                batches = list(rollouts)
            else:
                batches = self._draw()
            key = tuple(max(col) for col in zip(*(b.size_key for b in batches), strict=False))
            self._profiling = self.step_idx == ctx.measure.profile_step
            # the profiled step runs without the tracker (its dispatch mode would be most of
            # what the profiler sees); its batch shape is not recorded, so a later step of the
            # same shape is still tracked
            tracked = (ctx.measure.memory and not self._profiling
                       and self._tracked(self.step_idx, key))
            if tracked and self.step_idx >= 1:
                # shapes are compared from step 1 on: step 0 runs without optimizer state, so
                # a large step-0 batch must not hide a later, slightly smaller one that has it
                self._max_key = tuple(max(a, b) for a, b in zip(key, self._max_key or key,
                                                              strict=False))
            if self.probe.is_cuda:
                torch.cuda.synchronize()
            with self._profile() as prof:
                t0 = time.perf_counter()
                metrics = self.run_step(batches, tracked, reuse=reuse)
                if self.probe.is_cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            if prof is not None:
                res.profile = {"step": self.step_idx, **prof}
            real = sum(b.real_tokens for b in batches)
            res.real_tokens += real
            res.total_tokens += sum(b.total_tokens for b in batches)
            if self.step_idx >= ctx.measure.warmup_steps and not (tracked or self._profiling):
                res.timed_tokens += real
                res.timed_seconds += dt
                res.timed_samples += sum(b.meta.get("samples", 0) or 0 for b in batches)
                res.timed_steps += 1
                res.timed_rates.append(real / dt if dt > 0 else 0.0)
            metrics["throughput/tokens_per_s"] = real / dt if dt > 0 else 0.0
            metrics["data/padding_fraction"] = 1 - real / max(1, sum(b.total_tokens
                                                                     for b in batches))
            del batches  # freed before an evaluation (an online method keeps its rollouts)
            res.losses.append(metrics["train/loss"])
            res.metrics = metrics
            for k, v in metrics.items():
                if k != "train/loss" and not k.startswith("throughput/"):
                    res.curves.setdefault(k, []).append(v)
            self.step_idx += 1
            res.steps = self.step_idx
            if not math.isfinite(metrics["train/loss"]):
                raise NonFiniteLoss(self.step_idx, metrics["train/loss"])
            evaluated, best = self._evaluate() if self._eval_due() else ({}, False)
            interval = self.step_idx % ctx.train.log_every == 0 or bool(evaluated)
            if interval and ctx.rank == 0:
                self._say(metrics, evaluated)
            if self.logger is not None and interval:
                self.logger.log({**metrics, **self.probe.step_metrics(self.step_idx - 1),
                                 **evaluated}, step=self.step_idx)
            if bar is not None:
                post = {"loss": f"{metrics['train/loss']:.4f}",
                        "tok_s": f"{metrics['throughput/tokens_per_s']:.0f}"}
                shown = (evaluated.get(f"eval/{self.evaluator.state.metric}")
                         if self.evaluator is not None else None)
                if shown is not None:
                    post["eval"] = f"{shown:.4f}"
                bar.set_postfix(**post)
                bar.update(1)
            faults.reach(f"step:{self.step_idx}")
            if (ctx.train.save_every and self.step_idx % ctx.train.save_every == 0) or best:
                self.try_save_checkpoint()
            if self.evaluator is not None and self.evaluator.state.stopped is not None:
                break

    def _draw(self) -> list[Batch]:
        """The next step's micro-batches: ``train.grad_accum`` of them, fewer where
        ``train.epochs`` ends a pass (its last step takes the micro-batches left)."""
        out = []
        for _ in range(self.ctx.train.grad_accum):
            out.append(next(self.stream).to(self.ctx.device))
            if self.plan.by_epoch and self.stream.at_epoch_end():
                break
        return out

    def _say(self, metrics: dict[str, Any], evaluated: dict[str, Any]) -> None:
        """The log's line of this logging interval (the file's only: the bar shows it), and
        an evaluation's line (on the console too)."""
        def shown(values: dict[str, Any]) -> str:
            return ", ".join(f"{k} {v:.4g}" for k, v in values.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool))

        at = f"step {self.step_idx}/{self.steps}"
        runlog.file_only(f"{at}: {shown(metrics)}")
        if evaluated:
            state = self.evaluator.state if self.evaluator is not None else None
            best = state is not None and (state.best or {}).get("step") == self.step_idx
            runlog.say(f"eval at {at}: {shown(evaluated)}" + (" (best so far)" if best else ""))

    # ---------------------------------------------------------------- evaluation
    def _eval_due(self) -> bool:
        """Evaluate after this step: every ``train.eval_every`` steps and after the last."""
        every = self.ctx.train.eval_every
        return self.evaluator is not None and (self.step_idx >= self.steps
                                               or bool(every and self.step_idx % every == 0))

    def _evaluate(self) -> tuple[dict[str, Any], bool]:
        """Evaluate now: ``({"eval/<metric>": value}, whether to save it as the best)``.
        Decides early stopping (``evaluator.state.stopped``)."""
        ev, train = self.evaluator, self.ctx.train
        assert ev is not None
        metrics, improved = ev.run(self)
        st = ev.state
        out: dict[str, Any] = {f"eval/{k}": v for k, v in metrics.items()}
        new = [s for s in st.samples if s["step"] == self.step_idx]
        if new:
            out["eval/samples"] = new
        save = improved and train.save_best
        if save and st.best is not None:  # the directory the save below writes
            st.best["checkpoint"] = str(checkpoint.step_dir(Path(self.ctx.run_dir),
                                                            self.step_idx))
        if train.early_stop and st.since_best >= train.early_stop and \
                self.step_idx < self.steps:
            best = st.best or {}
            st.stopped = {"step": self.step_idx, "reason": (
                f"eval {st.metric} did not improve on {best.get('value')} (step "
                f"{best.get('step')}) in {st.since_best} evaluations (train.early_stop="
                f"{train.early_stop})")}
        return out, save

    def best_checkpoint(self) -> Path | None:
        """The best evaluation's checkpoint (``train.save_best``), which pruning keeps."""
        best = self.evaluator.state.best if self.evaluator is not None else None
        return Path(best["checkpoint"]) if best and best.get("checkpoint") else None

    def save_checkpoint(self):
        """A resumable checkpoint of the current step (:mod:`memlab.trainer.checkpoint`)."""
        faults.reach("checkpoint")
        return checkpoint.save(self)

    def try_save_checkpoint(self):
        """:meth:`save_checkpoint`, but a checkpoint that cannot be written (an unwritable,
        missing or full disk: :func:`memlab.trainer.checkpoint.is_write_failure`, whichever
        library raised it) is recorded in ``result.checkpoint_errors`` and the training goes
        on; returns the checkpoint's dir or None."""
        try:
            path = self.save_checkpoint()
            self.saved_step = self.step_idx
            return path
        except Exception as e:
            if not checkpoint.is_write_failure(e):
                raise
            self.result.checkpoint_errors.append(
                f"step {self.step_idx}: {type(e).__name__}: {e}")
            best = self.evaluator.state.best if self.evaluator is not None else None
            if best and best.get("checkpoint") and best["step"] == self.step_idx:
                best["checkpoint"] = None  # not written
            return None

    def _progress(self):
        if not self.ctx.train.progress or self.ctx.rank != 0:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.steps, initial=self.step_idx, desc="train",
                    dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
