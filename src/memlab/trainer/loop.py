"""A readable training loop: deterministic batches, gradient accumulation normalised over the
whole step, autocast / loss scaling, activation offload, per-phase memory, throughput,
progress bar, logging, resumable checkpoints.

One optimizer step = ``grad_accum`` micro-batches. The micro-batches of a step are collated
first so that (a) the loss is divided by the number of loss items of the *whole* step (then
1x8 and 8x1 give the same gradient) and (b) the probe knows the step's batch shapes before it
decides whether to run the step under the memory tracker.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memlab.distributed.base import unwrap
from memlab.measure.memory import MemoryProbe
from memlab.method.base import Batch, generates


def _scalar(x: Any) -> float:
    """``float(x)``; NaN for a fake tensor (``memlab estimate`` runs this loop on
    FakeTensorMode, where tensors have shapes but no values)."""
    if isinstance(x, torch.Tensor):
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(x):
            return float("nan")
        if hasattr(x, "full_tensor"):  # a DTensor (FSDP2's gradient norm)
            x = x.full_tensor()
    return float(x)


class BatchStream:
    """Deterministic, resumable stream of micro-batches: a seeded permutation per epoch.

    With ``shard=(rank, world_size)`` every rank walks the same permutation in global batches
    of ``batch_size * world_size`` rows and collates its own slice of each, so N ranks x batch
    B see exactly the rows one process sees with batch N*B."""

    def __init__(self, ds, batch_size: int, seed: int, collate: Callable[[list[dict]], Batch],
                 shard: tuple[int, int] = (0, 1)):
        if len(ds) == 0:
            raise ValueError("the prepared dataset is empty (every example was dropped?)")
        self.ds, self.batch_size, self.seed, self.collate = ds, batch_size, seed, collate
        self.rank, self.world = shard
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.ds), generator=g).tolist()

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation(self.epoch)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.pos >= len(self._perm):
            self.epoch += 1
            self.pos = 0
            self._perm = self._permutation(self.epoch)
        idx = self._perm[self.pos : self.pos + self.batch_size * self.world]
        self.pos += len(idx)
        if self.world > 1:  # this rank's slice; a short last batch is split as evenly
            per = -(-len(idx) // self.world)
            idx = idx[self.rank * per : (self.rank + 1) * per] or idx[-1:]
        cols = self.ds[idx]
        rows = [{k: cols[k][i] for k in cols} for i in range(len(idx))]
        return self.collate(rows)


@dataclass
class TrainResult:
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    curves: dict[str, list[float]] = field(default_factory=dict)
    """Every logged metric per step (rewards, accuracies, grad norm...)."""
    real_tokens: int = 0
    total_tokens: int = 0
    timed_tokens: int = 0
    timed_seconds: float = 0.0
    timed_samples: int = 0
    timed_steps: int = 0
    throughput_note: str = ""

    def throughput(self) -> dict[str, Any]:
        if self.timed_seconds <= 0:
            return {"tokens_per_s": None, "samples_per_s": None, "step_time_s": None,
                    "tokens": self.real_tokens, "note": "no timed steps"}
        return {
            "tokens_per_s": self.timed_tokens / self.timed_seconds,
            "samples_per_s": self.timed_samples / self.timed_seconds,
            "step_time_s": self.timed_seconds / max(1, self.timed_steps),
            "timed_steps": self.timed_steps,
            "tokens": self.real_tokens,
            **({"note": self.throughput_note} if self.throughput_note else {}),
        }

    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.total_tokens if self.total_tokens else 0.0


def build_optimizer(params: list[nn.Parameter], cfg) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas),
                             weight_decay=cfg.weight_decay)


def build_scheduler(opt: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    total, warm = max(1, cfg.steps), cfg.warmup_steps

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if cfg.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if cfg.scheduler == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


class Trainer:
    """Runs ``ctx.train.steps`` optimizer steps of ``method`` on ``models['policy']``."""

    def __init__(self, ctx, method, models: dict[str, nn.Module], stream: BatchStream,
                 logger=None, offload_handle=None):
        self.ctx, self.method, self.models, self.stream = ctx, method, models, stream
        self.logger = logger
        self.offload = offload_handle
        self.policy = models["policy"]
        self.dist = ctx.distributed
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
        # a wrapper that owns backward and the optimizer step (DeepSpeed's engine) built the
        # optimizer with build_optimizer; memlab's schedule drives the torch optimizer inside it
        self.engine_steps = hasattr(self.dist, "step")
        if self.engine_steps:
            self.opt = self.dist.optimizer(self.policy)
            self.scaler = None
        else:
            self.opt = build_optimizer(self.params, ctx.train)
            self.scaler = ctx.precision.grad_scaler(ctx.device)
        self.sched = build_scheduler(self.opt, ctx.train)
        self.step_idx = 0
        self.result = TrainResult()
        self.probe = MemoryProbe(ctx.device, enabled=ctx.measure.memory)
        self.probe.watch(*models.values(), self.opt)
        if hasattr(self.dist, "memory_roles"):  # the wrapper's own buffers, by category
            self.probe.roles = lambda: self.dist.memory_roles(self.policy)
        self._max_key: tuple[int, ...] = ()
        self._rollouts: list[Batch] | None = None

    # ---------------------------------------------------------------- one step
    def _tracked(self, step: int, key: tuple[int, ...]) -> bool:
        mode = self.ctx.measure.memory_steps
        if mode == "all":
            return True
        if isinstance(mode, int):
            return step < mode
        first = step < 2  # step 0: cold; step 1: the first with optimizer state
        bigger = not self._max_key or any(
            k > m for k, m in zip(key, self._max_key, strict=False))
        return first or bigger

    def run_step(self, batches: list[Batch], tracked: bool,
                 reuse: bool = False) -> dict[str, float]:
        """[generate,] forward + backward over the micro-batches, then one optimizer step. An
        online method's ``rollout`` replaces each prompt batch in ``batches`` by its generated
        training batch (so the caller counts the tokens actually trained on); with ``reuse``
        the batches are the last rollouts, trained on again (``method.num_iterations``)."""
        ctx, device = self.ctx, self.ctx.device
        world = ctx.world_size
        inputs = [t for b in batches for t in b.tensors.values()]
        sums: dict[str, float] = {}
        loss_total = 0.0
        with self.probe.step(self.step_idx, tracked, inputs):
            if generates(self.method) and not reuse:  # online: generate the training batches
                with self.probe.phase("generate"):
                    with ctx.precision.autocast(device):
                        batches[:] = [self.method.rollout(self.models, b, ctx)
                                      for b in batches]
                self._rollouts = list(batches)
            total_items = sum(b.num_items for b in batches)
            if world > 1:  # normalise by the items of the whole step on every rank
                total_items = int(self.dist.all_reduce_sum([total_items], device)[0])
            # DDP averages gradients over ranks; scaling by the world size makes that average
            # the gradient of (sum of every rank's loss) / (all items): N ranks x B == 1 x N*B
            scale = world / max(1, total_items)
            for i, b in enumerate(batches):
                with self.dist.sync(self.policy, last=i == len(batches) - 1):
                    with self.probe.phase("forward"):
                        with ctx.precision.autocast(device), self._offload_ctx():
                            loss_sum, metrics = self.method.loss(self.models, b, ctx)
                        loss = loss_sum * scale
                    with self.probe.phase("backward"):
                        if self.engine_steps:
                            self.dist.backward(self.policy, loss)
                        else:
                            (self.scaler.scale(loss) if self.scaler else loss).backward()
                del loss_sum
                self.probe.micro_end()
                loss_total += _scalar(loss.detach()) / world
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + _scalar(v) * b.num_items
                del loss
                if self.offload is not None and hasattr(self.offload, "reset"):
                    self.offload.reset()
            with self.probe.phase("optimizer"):
                gnorm = self._optimizer_step()
        if world > 1:  # the step's loss and metrics over every rank's items
            keys = sorted(sums)
            reduced = self.dist.all_reduce_sum([loss_total, *(sums[k] for k in keys)], device)
            loss_total, sums = reduced[0], dict(zip(keys, reduced[1:], strict=True))
        out = {"train/loss": loss_total, "train/lr": self.sched.get_last_lr()[0]}
        if gnorm is not None:
            out["train/grad_norm"] = gnorm
        for k, v in sums.items():
            out[k] = v / max(1, total_items)
        return out

    def _optimizer_step(self) -> float | None:
        """Unscale, clip, step, schedule, zero the gradients; the gradient norm before clipping
        (None without ``train.max_grad_norm``)."""
        max_norm = self.ctx.train.max_grad_norm
        if self.engine_steps:  # the engine reduces at the boundary, clips, steps, zeroes
            norm = self.dist.step(self.policy)
            self.sched.step()
            return None if max_norm is None else norm
        if self.scaler:
            self.scaler.unscale_(self.opt)
        gnorm = None
        if max_norm is not None:
            gnorm = _scalar(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return gnorm

    def _offload_ctx(self):
        return self.ctx.offload.forward_context(self.offload)

    # ---------------------------------------------------------------- the loop
    def train(self) -> TrainResult:
        ctx, res = self.ctx, self.result
        if ctx.train.resume_from:
            self.load_checkpoint(self._resolve_resume(ctx.train.resume_from))
        for m in self.models.values():
            m.train(m is self.policy)
        bar = self._progress()
        every = getattr(self.method, "num_iterations", 1) if generates(self.method) else 1
        self._rollouts = None
        while self.step_idx < ctx.train.steps:
            # online methods with num_iterations > 1 generate on every num_iterations-th step
            # and train on those rollouts again in between (no new prompts drawn)
            reuse = every > 1 and self.step_idx % every != 0 and self._rollouts is not None
            if reuse:
                batches = list(self._rollouts)
            else:
                batches = [next(self.stream).to(ctx.device) for _ in range(ctx.train.grad_accum)]
            key = tuple(max(col) for col in zip(*(b.size_key for b in batches), strict=False))
            tracked = ctx.measure.memory and self._tracked(self.step_idx, key)
            if tracked and self.step_idx >= 1:
                # shapes are compared from step 1 on: step 0 runs without optimizer state, so
                # a large step-0 batch must not hide a later, slightly smaller one that has it
                self._max_key = tuple(max(a, b) for a, b in zip(key, self._max_key or key,
                                                              strict=False))
            if self.probe.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = self.run_step(batches, tracked, reuse=reuse)
            if self.probe.is_cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            real = sum(b.real_tokens for b in batches)
            res.real_tokens += real
            res.total_tokens += sum(b.total_tokens for b in batches)
            if self.step_idx >= ctx.measure.warmup_steps and not tracked:
                res.timed_tokens += real
                res.timed_seconds += dt
                res.timed_samples += sum(b.meta.get("samples", 0) or 0 for b in batches)
                res.timed_steps += 1
            metrics["throughput/tokens_per_s"] = real / dt if dt > 0 else 0.0
            metrics["data/padding_fraction"] = 1 - real / max(1, sum(b.total_tokens
                                                                     for b in batches))
            res.losses.append(metrics["train/loss"])
            res.metrics = metrics
            for k, v in metrics.items():
                if k != "train/loss" and not k.startswith("throughput/"):
                    res.curves.setdefault(k, []).append(v)
            self.step_idx += 1
            res.steps = self.step_idx
            if not math.isfinite(metrics["train/loss"]):
                raise FloatingPointError(f"loss is {metrics['train/loss']} at step "
                                         f"{self.step_idx}; lower train.lr or check the data")
            if self.logger is not None and self.step_idx % ctx.train.log_every == 0:
                self.logger.log(metrics, step=self.step_idx)
            if bar is not None:
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}",
                                tok_s=f"{metrics['throughput/tokens_per_s']:.0f}")
                bar.update(1)
            if ctx.train.save_every and self.step_idx % ctx.train.save_every == 0:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        if res.timed_steps == 0:
            self._fallback_timing()
        return res

    def _fallback_timing(self) -> None:
        self.result.throughput_note = (
            "every step was warm-up or ran under the memory tracker; raise train.steps or set "
            "measure.memory_steps=2 for a throughput number"
        )

    def _progress(self):
        if not self.ctx.train.progress or self.ctx.rank != 0:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.ctx.train.steps, initial=self.step_idx, desc="train",
                    dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    # ---------------------------------------------------------------- checkpoints
    def _named_trainable(self) -> dict[str, nn.Parameter]:
        """Trainable parameters by name: the policy's as named in the unwrapped model, other
        models' prefixed with their role (``value::...``)."""
        out: dict[str, nn.Parameter] = {}
        for role, m in self.models.items():
            prefix = "" if role == "policy" else f"{role}::"
            for n, p in unwrap(m).named_parameters():
                if p.requires_grad:
                    out.setdefault(prefix + n, p)
        return out

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu() for n, p in self._named_trainable().items()}

    def save_checkpoint(self) -> Path:
        """Resumable state: trainable weights, optimizer, scheduler, scaler, data position, RNG.
        Replicated ranks (DDP) hold the same state: rank 0 writes it, every rank can load it."""
        root = Path(self.ctx.run_dir) / "checkpoints"
        final = root / f"step_{self.step_idx:06d}"
        tmp = root / f".tmp_step_{self.step_idx:06d}"
        fmt = self._checkpoint_format()
        weights = optim = None
        if fmt == "native":  # every rank writes its own shards (DeepSpeed), then meets;
            # the whole weights go in state.pt too, readable without DeepSpeed
            self.dist.save_states(self.policy, tmp)
            weights = self.dist.full_weights(self.policy)
            if self.ctx.world_size > 1:
                torch.distributed.barrier()
        elif fmt == "by_name":  # gathered by every rank (a collective), written by rank 0
            weights, optim = self.dist.full_state(self.policy, self.opt)
        if self.ctx.rank != 0:
            return final
        if fmt == "torch":
            weights, optim = self._trainable_state(), self.opt.state_dict()
        tmp.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step_idx,
            "weights": weights,
            "optimizer": optim,
            "optimizer_format": fmt,
            "scheduler": self.sched.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "stream": self.stream.state(),
            "losses": self.result.losses,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }
        torch.save(state, tmp / "state.pt")
        if final.exists():
            import shutil

            shutil.rmtree(final)
        tmp.rename(final)
        return final

    def _checkpoint_format(self) -> str:
        """native: the wrapper writes its own shards (DeepSpeed); by_name: gathered from
        FSDP2's shards; torch: one replica's state dicts."""
        if hasattr(self.dist, "save_states"):
            return "native"
        return "by_name" if self.dist.shards_states() else "torch"

    def _resolve_resume(self, where: str) -> Path:
        if where == "latest":
            found = sorted((Path(self.ctx.run_dir) / "checkpoints").glob("step_*"))
            if not found:
                raise FileNotFoundError("train.resume_from=latest: no checkpoint under "
                                        f"{self.ctx.run_dir}/checkpoints")
            return found[-1]
        return Path(where)

    def load_checkpoint(self, path: Path) -> None:
        state = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
        fmt, want = state.get("optimizer_format", "torch"), self._checkpoint_format()
        if fmt != want:
            kinds = {"torch": "a replicated run (single or ddp)",
                     "by_name": "a sharded run (distributed=fsdp2)",
                     "native": "distributed=deepspeed"}
            raise ValueError(f"checkpoint {path} was written by {kinds.get(fmt, fmt)}; resume "
                             f"it with the same kind of setup (this run is {kinds[want]})")
        if fmt == "native":
            self.dist.load_states(self.policy, path)
        elif fmt == "by_name":
            self.dist.load_full_state(self.policy, self.opt, state["weights"],
                                      state["optimizer"])
        else:
            named = self._named_trainable()
            with torch.no_grad():
                for n, t in state["weights"].items():
                    named[n].copy_(t.to(named[n].device, named[n].dtype))
            self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.stream.load_state(state["stream"])
        self.step_idx = state["step"]
        self.result.losses = list(state["losses"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
