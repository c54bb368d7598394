"""Evaluation while training: the held-out set's metrics every ``train.eval_every`` steps and
after the last step, the best of them (``train.save_best``), early stopping
(``train.early_stop``) and a few greedy sample completions (``train.eval_samples``).

**The numbers.** Every held-out micro-batch goes through the method's ``evaluate`` (the loss and
its metrics for methods that train on a dataset, the reward of greedy completions for online
methods) without gradients, the policy in eval mode. Each returns its metrics *summed* over its
items (loss tokens, pairs, prompts), and the trainer adds those sums over the whole held-out set
and every rank before dividing once by all the items: the eval loss is weighted by tokens (or
pairs) over the whole set, so it is the same for any ``train.eval_batch_size``, with or without
packing, on any number of ranks (tested).

**Ranks.** The ranks split the held-out set as they split training batches: global batches of
``rows x ranks`` items, each rank its slice. Every rank runs the same number of micro-batches (a
wrapper's forward may hold a collective: DDP's buffer broadcast, FSDP2's all-gathers); a rank
whose slice of the last batch is empty runs one item again and does not count it.

**Memory.** Each micro-batch is its own probe step in the ``eval`` phase (no gradient exists
there; the optimizer's state does), tracked during the first evaluation whenever its batch
shape is larger than any tracked before (as ``measure.memory_steps=auto`` tracks training
steps); its time is never part of training tokens/s.

**State.** :class:`EvalState` holds what a resumed run must know: every evaluation so far, the
best value, its step and checkpoint, and the evaluations since it improved (early stopping's
count); checkpoints store it (:mod:`memlab.trainer.checkpoint`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memlab.trainer.routing import unwrap


@dataclass
class EvalState:
    """The evaluations so far and what ``save_best`` / ``early_stop`` follow."""

    metric: str
    greater_is_better: bool
    history: list[dict[str, Any]] = field(default_factory=list)
    """One entry per evaluation: ``{"step", <metric>: value..., "seconds"}``."""
    best: dict[str, Any] | None = None
    """``{"step", "value", "checkpoint"}`` of the best evaluation (checkpoint: None unless
    ``save_best`` wrote one)."""
    since_best: int = 0
    """Evaluations in a row without an improvement (early stopping's count)."""
    stopped: dict[str, Any] | None = None
    """``{"step", "reason"}`` when early stopping ended the run."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """``{"step", "prompt", "completion"}`` of every evaluation's sample completions."""

    def improves(self, value: float) -> bool:
        """Whether ``value`` is better than the best so far (a NaN never is)."""
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        best = self.best["value"]
        return value > best if self.greater_is_better else value < best

    def record(self, step: int, metrics: dict[str, float]) -> bool:
        """Add an evaluation's metrics; returns whether it is the new best."""
        self.history.append({"step": step, **metrics})
        value = metrics.get(self.metric, float("nan"))
        if self.improves(value):
            self.best = {"step": step, "value": value, "checkpoint": None}
            self.since_best = 0
            return True
        self.since_best += 1
        return False

    def state(self) -> dict[str, Any]:
        """Plain JSON (a checkpoint's ``eval``)."""
        return {"metric": self.metric, "greater_is_better": self.greater_is_better,
                "history": self.history, "best": self.best, "since_best": self.since_best,
                "samples": self.samples}

    def load_state(self, state: dict[str, Any]) -> None:
        """What a checkpoint recorded (a checkpoint of a run that followed another metric only
        contributes its history: the best and the count start again)."""
        self.history = list(state.get("history") or [])
        self.samples = list(state.get("samples") or [])
        if (state.get("metric"), state.get("greater_is_better")) == (self.metric,
                                                                   self.greater_is_better):
            self.best = state.get("best")
            self.since_best = int(state.get("since_best") or 0)


def _same_shape_or_smaller(key: tuple[int, ...], seen: list[tuple[int, ...]]) -> bool:
    return any(len(k) == len(key) and all(a <= b for a, b in zip(key, k, strict=True))
               for k in seen)


class Evaluator:
    """Evaluates the policy on the held-out set (module docstring).

    ``ds``: the prepared (and packed) held-out rows; ``collate``: rows -> a :class:`Batch`;
    ``items``: dataset items per micro-batch (rows, or 1 where an item is a packed group);
    ``env``: the run's generation environment (online methods) or None; ``sample``:
    ``(policy, prompt ids) -> completion texts`` (greedy) for ``prompts``, the sample prompts'
    token ids, decoded by ``decode``."""

    def __init__(self, ctx, method, ds, collate: Callable[[list[dict]], Any], items: int, *,
                 env: Any = None, sample: Callable[[Any, list[list[int]]], list[str]] | None = None,
                 prompts: list[list[int]] | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        self.ctx, self.method, self.ds, self.collate = ctx, method, ds, collate
        self.items, self.env, self.sample = items, env, sample
        self.prompts, self.decode = list(prompts or []), decode
        metric, greater = ctx.train.best(method)
        self.state = EvalState(metric, greater)
        self.runs = 0
        self.seconds = 0.0
        self._tracked_keys: list[tuple[int, ...]] = []

    # ---------------------------------------------------------------- batches
    def slices(self) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches: ``(dataset items, counted)``; every rank gets as many."""
        rank, world = self.ctx.rank, self.ctx.world_size
        n, per_batch = len(self.ds), self.items * world
        out = []
        for start in range(0, n, per_batch):
            idx = list(range(start, min(n, start + per_batch)))
            per = -(-len(idx) // world)
            mine = idx[rank * per:(rank + 1) * per]
            out.append((mine, True) if mine else (idx[-1:], False))
        return out

    def rows(self, idx: list[int]) -> list[dict]:
        """The prepared held-out rows ``idx``."""
        cols = self.ds[idx]
        return [{k: cols[k][i] for k in cols} for i in range(len(idx))]

    # ---------------------------------------------------------------- one evaluation
    def run(self, trainer) -> tuple[dict[str, float], bool]:
        """Evaluate the policy now (after ``trainer.step_idx`` steps): the metrics (also
        recorded in :attr:`state`) and whether they are the best so far."""
        ctx, policy = self.ctx, trainer.policy
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        seen: set[str] = set()  # every metric reported, counted or not (the same on every rank)
        items = 0
        if self.env is not None:  # an engine with its own weights takes the policy's
            with trainer.dist.generation(policy):
                self.env.sync(policy)
        with self._eval_mode(trainer.models), torch.no_grad():
            for idx, counted in self.slices():
                batch = self.collate(self.rows(idx)).to(ctx.device)
                got, n = self.step(trainer, batch, self._tracked(batch.size_key))
                del batch
                seen.update(got)
                if counted:
                    items += n
                    for k, v in got.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
        # the method's metrics, then any it adds (one per reward function of an online method)
        keys = [*self.method.eval_metrics, *sorted(seen - set(self.method.eval_metrics))]
        # items, then per metric its sum and whether this rank has it (a metric a method
        # reports only for some batches, or a rank with no counted batch)
        values = [float(items), *(x for k in keys for x in (sums.get(k, 0.0), float(k in sums)))]
        if ctx.world_size > 1:  # the sums of every rank
            values = trainer.dist.all_reduce_sum(values, ctx.device)
        total = values[0]
        metrics = {k: values[1 + 2 * i] / total for i, k in enumerate(keys)
                   if total and values[2 + 2 * i]}
        self.runs += 1
        if self.sample is not None and self.prompts:
            self._samples(trainer)
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        improved = self.state.record(trainer.step_idx, {**metrics, "seconds": seconds})
        return metrics, improved

    def step(self, trainer, batch, tracked: bool) -> tuple[dict[str, float], int]:
        """One held-out micro-batch: a probe step (``tracked``: under the memory tracker) in
        the ``eval`` phase; the method's sums and items (no gradients: the caller's
        ``torch.no_grad`` and eval mode; :meth:`measure` for one batch alone)."""
        ctx, probe = self.ctx, trainer.probe
        with probe.step(trainer.step_idx, tracked, batch.tensor_list(), training=False):
            with trainer._phase("eval"), ctx.precision.autocast(ctx.device):
                out = self.method.evaluate(trainer.models, batch, ctx, self.env)
            probe.micro_end()
        return out

    def measure(self, trainer, batch) -> None:
        """``batch`` as a tracked held-out micro-batch, alone (what ``memlab estimate``
        measures the ``eval`` phase with)."""
        with self._eval_mode(trainer.models), torch.no_grad():
            self.step(trainer, batch, True)

    def _tracked(self, key: tuple[int, ...]) -> bool:
        """Tracked in the first evaluation, when no larger batch was tracked before."""
        if not self.ctx.measure.memory or self.runs > 0:
            return False
        if _same_shape_or_smaller(key, self._tracked_keys):
            return False
        self._tracked_keys.append(key)
        return True

    def _samples(self, trainer) -> None:
        """Greedy completions of the sample prompts (every rank generates them: a sharded
        policy's forward is a collective; rank 0 records them)."""
        probe, sample = trainer.probe, self.sample
        assert sample is not None
        with self._eval_mode(trainer.models), probe.step(trainer.step_idx, False, training=False):
            with trainer._phase("eval"):
                texts = sample(trainer.policy, self.prompts)
        if self.ctx.rank == 0:
            step, decode = trainer.step_idx, self.decode or str
            self.state.samples += [{"step": step, "prompt": decode(p), "completion": c}
                                   for p, c in zip(self.prompts, texts, strict=True)]

    @contextlib.contextmanager
    def _eval_mode(self, models: dict):
        """Every model in eval mode (no dropout), their training modes restored after."""
        modes = [(m, m.training, unwrap(m).training) for m in models.values()]
        for m, _, _ in modes:
            m.eval()
        try:
            yield
        finally:
            for m, outer, inner in modes:
                m.train(outer)
                unwrap(m).train(inner)

    # ---------------------------------------------------------------- the summary
    def _batch_record(self) -> dict[str, Any]:
        """``batch_size``: the rows of the largest evaluation micro-batch that ran; when the
        held-out rows cannot fill one of ``train.eval_batch_size`` rows, also
        ``batch_size_asked`` and a note (the eval phase's memory is that smaller batch's; the
        eval loss does not depend on it, so the run goes on)."""
        asked = self.ctx.train.eval_rows()
        if self.items != asked:  # items are whole packs (preference pairs packed in groups)
            return {"batch_size": asked}
        largest = max((len(idx) for idx, counted in self.slices() if counted), default=0)
        if largest >= asked:
            return {"batch_size": asked}
        return {"batch_size": largest, "batch_size_asked": asked,
                "batch_note": f"the held-out data has {len(self.ds)} rows: every evaluation "
                              f"micro-batch held at most {largest}, fewer than "
                              f"train.eval_batch_size={asked}"}

    def summary(self, held: dict[str, Any]) -> dict[str, Any]:
        """summary.json's ``eval``: ``held`` (where the rows come from, how many) plus the
        evaluations, the best and how the run ended."""
        st = self.state
        return {
            **held,
            "every": self.ctx.train.eval_every,
            **self._batch_record(),
            "metric": st.metric,
            "greater_is_better": st.greater_is_better,
            "final": ({k: v for k, v in st.history[-1].items() if k != "seconds"}
                      if st.history else None),
            "best": st.best,
            "stopped_early": st.stopped,
            "history": st.history,
            "samples": st.samples,
            "seconds": self.seconds,
        }
