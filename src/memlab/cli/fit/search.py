"""``memlab fit``'s search: estimate every candidate, rank the ones that fit, measure the best.

1. **Estimate** (:func:`estimate_all`): the candidates of the space (:mod:`.space`) are
   estimated on fake tensors (``memlab estimate``, no device memory; ``jobs`` at a time in
   worker processes) with their FLOPs counted, except those :mod:`.prune` shows need no
   estimate of their own (a twin's estimate, a smaller micro-batch that does not fit, a
   dominating candidate that fits, parameters that alone do not fit), each stopped once its
   need is known not to fit (``over_budget``); a candidate *fits* when its estimated need times
   ``1 + margin`` is within the budget. :mod:`.progress` shows it going.
2. **Rank** (:func:`rank`): the cheap speed model (:func:`score`) orders the fitting
   candidates by the predicted seconds of one optimizer step (:func:`predicted_seconds`: the
   FLOPs counted on the fake step, the recomputation checkpointing adds included, at the
   card's rate, plus offloaded activations over its host link), then fewer micro-batches per
   step (each has a fixed cost),
   then padding-free / packed before padded (the worst-case batch the estimate runs has no
   padding, so the FLOP count cannot see what padding costs on real data).
3. **Measure** (:func:`measure`): the best candidate of each of the ``measure`` fastest
   predicted classes (:func:`to_measure`), and the configuration as given when it fits, train for a few steps, each in a fresh ``python -m memlab`` process as a sweep
   job would (its summary.json: peak, tokens/s over the untimed-free steps with their spread,
   the loss curve). More are measured, down the ranking, while none of the measured fits.
   Each run is in its own session with its console in ``runs/<i>.log``: when fit is stopped,
   it stops the run in order (:func:`stop_run`: the run records what it measured), and a
   measurement that was interrupted or killed is never taken for a result
   (:class:`SearchInterrupted`: no verdict).
4. **Choose** (:func:`fastest`): the fastest measured run whose *measured* peak is within the
   budget and that has at least :data:`MIN_TIMED` timed steps; runs within the measured spread
   of it are a tie: fit measures the tied (and the untimed) again with twice the steps while
   ``--measure-budget`` lasts, and a tie left is broken by the speed model's order only once it
   ordered :data:`MIN_MODEL_POINTS` timed candidates better than chance
   (:func:`prediction_quality`: Spearman's rank correlation of predicted order and measured
   tokens/s), else by the smaller measured peak ("tied within X%": :func:`ties`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from memlab.cli.fit.progress import Progress
from memlab.cli.fit.prune import Plan
from memlab.cli.fit.runs import (  # noqa: F401  (re-exported: fit's measured runs)
    STOP_GRACE_S,
    UNFINISHED,
    SearchInterrupted,
    _short,
    read_run,
    run_log,
    run_once,
    stop_run,
)
from memlab.cli.fit.space import Candidate
from memlab.cli.fit.speed import (  # noqa: F401  (re-exported: how fit judges speed)
    MIN_MODEL_POINTS,
    MIN_TIMED,
    _tied,
    contenders,
    fastest,
    judge,
    micro_batches,
    prediction_quality,
    score,
    spearman,
    ties,
    timed,
)

MEASURE_BUDGET_S = 180.0
"""``--measure-budget``'s default: seconds of measured runs in all."""


@dataclass(kw_only=True)
class FitOptions:
    budget_bytes: int
    device: Literal["cpu", "cuda"] = "cpu"
    card: str | None = None
    allow: tuple[str, ...] = ()
    margin: float = 0.05
    """Safety margin on the estimate: a candidate fits when estimate x (1 + margin) <= budget."""
    measure: int = 3
    """Candidates measured with real runs (plus the configuration as given, when it fits)."""
    steps: int = 10
    """Optimizer steps of each measured run (the first is warm-up, some are tracked)."""
    estimate_only: bool = False
    jobs: int = 1
    """Candidates estimated at a time, each in a worker process (``--jobs``)."""
    exhaustive: bool = False
    """Estimate every candidate (``--exhaustive``): no shared estimate, no pruning."""
    measure_budget_s: float = MEASURE_BUDGET_S
    """Seconds of measured runs in all (``--measure-budget``): the first runs always go, then
    tied or untimed top candidates are measured again, longer, while it lasts."""


def fits_below(opts: FitOptions) -> int:
    """The largest need (bytes) that fits: ``need * (1 + margin) <= budget``, computed as
    :func:`estimate_candidate` judges it (so that any larger need does not fit)."""
    n = int(opts.budget_bytes / (1 + opts.margin))
    while (n + 1) * (1 + opts.margin) <= opts.budget_bytes:
        n += 1
    while n >= 0 and n * (1 + opts.margin) > opts.budget_bytes:
        n -= 1
    return n


def estimate_candidate(base: list[str], c: Candidate, opts: FitOptions,
                       stop: bool = False) -> dict[str, Any]:
    """One candidate's estimate as fit keeps it (status, peak, need, fits, flops, error).
    ``stop``: the estimate stops once its need is known not to fit (status ``over_budget``,
    ``needed_at_least_bytes``: :mod:`.prune`'s lever 4)."""
    from memlab.cli.estimate import estimate_one
    from memlab.estimate import EstimateOptions

    eopts = EstimateOptions(device=opts.device, card=opts.card, budget_bytes=opts.budget_bytes,
                            count_flops=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    est = estimate_one([*base, *c.overrides], eopts,
                       stop_above=fits_below(opts) if stop else None)
    if est["status"] == "over_budget":
        return {"status": "over_budget", "error": _short(est.get("error")),
                "needed_at_least_bytes": est["needed_at_least_bytes"], "fits": False,
                "seconds": round(time.perf_counter() - t0, 2),
                "cpu_s": round(time.process_time() - cpu0, 2)}
    need = (est.get("verdict") or {}).get("needed_bytes") or est.get("peak_bytes")
    counted = est.get("flops") or {}
    flops = counted.get("per_step")
    # the offloader's counters add up every micro-batch the estimate ran, as the FLOPs do
    moved = ((est.get("offload") or {}).get("offloaded_bytes") or 0) * max(1, micro_batches(c)) \
        // max(1, counted.get("micro_batches") or 1)
    return {
        "status": est["status"], "error": _short(est.get("error")),
        "peak_bytes": est.get("peak_bytes"), "needed_bytes": need,
        "by_category": est.get("by_category"),
        "flops_per_step": flops, "offloaded_bytes_per_step": moved,
        "predicted_s": predicted_seconds(flops, moved, opts.card),
        "fits": bool(est["status"] == "ok" and need is not None
                     and need * (1 + opts.margin) <= opts.budget_bytes),
        "seconds": round(time.perf_counter() - t0, 2),
        "cpu_s": round(time.process_time() - cpu0, 2),
    }


def _worker_init() -> None:
    """A worker of :func:`estimate_all`: fit's own process handles Ctrl-C, SIGTERM and SIGHUP
    (it stops the workers and writes what it has). One intra-op thread, as in every process
    forked after an estimate (:func:`memlab.estimate.forked.fork_safe_threads`)."""
    from memlab.estimate.forked import fork_safe_threads

    fork_safe_threads()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _estimate_in_worker(job: tuple[int, list[str], Candidate, FitOptions, bool]
                        ) -> tuple[int, dict[str, Any]]:
    i, base, c, opts, stop = job
    return i, estimate_candidate(base, c, opts, stop)


def estimate_all(base: list[str], plan: Plan, opts: FitOptions,
                 progress: Progress) -> None:
    """Estimate the candidates ``plan`` does not prune or share (:mod:`.prune`; each
    ``cand.estimate``: :func:`estimate_candidate`): the first in this process, the others
    ``opts.jobs`` at a time in worker processes forked from it (they share what it loaded and
    warmed up); a candidate's estimate is the same whichever process makes it. A candidate is
    sent out once every candidate that could prune it is settled, smaller micro-batches and less
    checkpointing first. Interrupted (Ctrl-C, or SIGTERM / SIGHUP turned into one by fit), the
    workers are stopped and the candidates estimated so far keep their estimates."""
    import queue

    pending = list(plan.reps)

    def settle_pruned() -> None:
        moved = True
        while moved:
            moved = False
            for i in list(pending):
                if plan.ready(i):
                    why = plan.pruned(i)
                    if why is not None:
                        pending.remove(i)
                        plan.settle(i, pruned=why)
                        progress.note(plan)
                        moved = True

    def next_ready() -> int | None:
        settle_pruned()
        for i in pending:
            if plan.ready(i):
                pending.remove(i)
                return i
        return None

    def done(i: int, est: dict[str, Any]) -> None:
        plan.settle(i, estimate=est)
        progress.estimated(plan, i)

    jobs = max(1, min(opts.jobs, len(pending)))
    first = next_ready()
    if first is None:
        return
    progress.started(plan, first)
    # the first here: the workers, forked after it, start warm (the modules an estimate imports
    # on first use, torch's fake-tensor dispatch caches): ~15 s each on 2 cores otherwise
    done(first, estimate_candidate(base, plan.cands[first], opts, plan.stoppable(first)))
    if jobs == 1:
        while (i := next_ready()) is not None:
            progress.started(plan, i)
            done(i, estimate_candidate(base, plan.cands[i], opts, plan.stoppable(i)))
        return
    import multiprocessing

    results: queue.Queue = queue.Queue()
    pool = multiprocessing.get_context("fork").Pool(jobs, initializer=_worker_init,
                                                     maxtasksperchild=None)
    flying: set[int] = set()
    try:
        while True:
            while len(flying) < jobs and (i := next_ready()) is not None:
                flying.add(i)
                progress.started(plan, i)
                pool.apply_async(_estimate_in_worker,
                                 ((i, base, plan.cands[i], opts, plan.stoppable(i)),),
                                 callback=results.put, error_callback=results.put)
            if not flying:
                break
            try:
                got = results.get(timeout=1.0)
            except queue.Empty:
                progress.tick(plan)
                continue
            if isinstance(got, BaseException):
                raise got
            i, est = got
            flying.discard(i)
            done(i, est)
    except BaseException:  # stopped (a signal) or an estimate failed: the workers end now
        pool.terminate()  # SIGTERM: each worker set it to its default (_worker_init), and one
        pool.join()  # forked a moment before ends in fit's handler (_signals_interrupt)
        raise
    pool.close()  # done: each worker reads its end from the queue and exits; no signal sent
    pool.join()


MFU = 0.4
"""The share of a card's tensor-core rate a training step reaches (the speed model's one
assumption about efficiency; only the balance of compute and host copies depends on it)."""


def predicted_seconds(flops: int | None, offloaded_bytes: int, card: str | None) -> float | None:
    """Seconds of one optimizer step: its FLOPs at ``MFU`` of the card's rate, plus offloaded
    activations copied to the host and back over its link, not overlapped (an upper bound).
    Without a card (CPU): the FLOPs at a nominal 1 TFLOP/s (an order, not a time)."""
    from memlab.estimate import CARDS

    if flops is None:
        return None
    if card is None:
        return flops / 1e12
    spec = CARDS[card]
    return flops / (spec["tflops"] * 1e12 * MFU) + 2 * offloaded_bytes / (spec["host_gbs"] * 1e9)


def overhead(c: Candidate) -> int:
    """What ``c`` spends only to save memory: its checkpointing level (0 none, 1 every 2nd
    layer, 2 every layer) plus 1 when it offloads activations (:mod:`.prune`'s dominance)."""
    return c.coords.get("checkpointing", 0) + c.coords.get("offload", 0)


def rank_key(c: Candidate) -> tuple[Any, ...]:
    """:func:`rank`'s order: :func:`score`, then exact first, then less :func:`overhead`,
    then the smaller estimate."""
    return (*score(c), not c.exact, overhead(c), c.estimate.get("needed_bytes") or 0)


def rank(cands: list[Candidate]) -> list[Candidate]:
    """The fitting candidates, fastest predicted first (see the module docstring); among
    candidates the speed model cannot tell apart, those that train exactly as configured, then
    those with less checkpointing and offloading (which cost time the model may round away),
    then the smaller estimate, come first."""
    fitting = [c for c in cands if c.estimate.get("fits")]
    fitting.sort(key=rank_key)
    for i, c in enumerate(fitting):
        c.predicted_rank = i + 1
    return fitting


def to_measure(ranked: list[Candidate], k: int) -> list[Candidate]:
    """The first of each of the ``k`` fastest predicted classes (candidates with the same
    :func:`score` are one class: measuring two of them would not test the speed model), then
    the next in order if there are fewer classes."""
    picked: list[Candidate] = []
    seen: set[tuple[float, int, int]] = set()
    for c in ranked:
        if score(c) not in seen and len(picked) < k:
            picked.append(c)
            seen.add(score(c))
    for c in ranked:
        if len(picked) >= k:
            break
        if c not in picked:
            picked.append(c)
    return picked


def measure(base: list[str], ranked: list[Candidate], baseline: Candidate | None,
            opts: FitOptions, out_dir: Path, log: Callable[[str], None]) -> list[Candidate]:
    """Measure the best ``opts.measure`` candidates (and ``baseline``), then further down the
    ranking while none measured fits; then, while ``opts.measure_budget_s`` lasts, measure
    again, with twice the steps, the fitting candidates that are not timed (fewer than
    :data:`MIN_TIMED` timed steps) or tied with the fastest within their spreads
    (:func:`contenders`). Returns the measured candidates."""
    todo = to_measure(ranked, opts.measure)
    rest = [c for c in ranked if c not in todo]
    if baseline is not None and baseline not in todo:
        todo.append(baseline)
    done: list[Candidate] = []
    runs = 0
    spent = 0.0
    steps = {id(c): opts.steps for c in ranked}

    def run(c: Candidate) -> None:
        nonlocal runs, spent
        run_dir = out_dir / "runs" / str(runs)
        runs += 1
        n = steps.get(id(c), opts.steps)
        log(f"[fit] measure {c.label} ({n} steps) -> {run_dir}")
        earlier = c.measured
        try:
            c.measured = run_once([*base, *c.overrides], n, run_dir)
        except BaseException:  # fit was stopped: the run was too, and recorded what it had
            c.measured = {**read_run(run_dir), "fits": False}
            raise
        spent += c.measured.get("wall_s") or 0.0
        judge(c, opts.budget_bytes)
        if earlier is not None:  # keep the run with more timed steps; the other is listed
            older = [*earlier.pop("earlier", []), earlier]
            if (earlier.get("timed_steps") or 0) > (c.measured.get("timed_steps") or 0):
                older[-1], c.measured = c.measured, earlier
            c.measured["earlier"] = older

    while todo:
        c = todo.pop(0)
        done.append(c)
        run(c)
        if not todo and rest and len(done) < 2 * opts.measure + 1 and not any(
                d.run()["fits"] and timed(d.run()) for d in done):
            todo.append(rest.pop(0))
    while True:
        again = contenders(done)
        if not again:
            break
        cost = sum((c.run().get("wall_s") or 0.0) * 2 for c in again)
        if spent + cost > opts.measure_budget_s:
            log(f"[fit] measured {spent:.0f} s; measuring {len(again)} tied or untimed "
                f"candidates again would pass --measure-budget {opts.measure_budget_s:.0f} s")
            break
        for c in again:
            steps[id(c)] = 2 * steps.get(id(c), opts.steps)
            run(c)
    return done


def complete_closest(base: list[str], plan: Plan, opts: FitOptions, k: int = 3) -> None:
    """Where nothing fits, estimate to their end the candidates a lever left with only a lower
    bound on their need (an estimate stopped over the budget, parameters too large, a smaller
    micro-batch not fitting) that could still be among the ``k`` :func:`closest`, so that
    those are what estimating every candidate finds."""
    cands = plan.cands
    while True:
        needs = sorted(_nearest_need(c) for c in cands if c.estimate.get("status") == "ok")
        kth = needs[k - 1] if len(needs) >= k else None
        todo = [r for r in plan.reps if (lb := _lower_bound(cands[r])) is not None
                and (kth is None or lb <= kth)]
        if not todo:
            return
        for r in todo:
            est = estimate_candidate(base, cands[r], opts)
            cands[r].pruned = None
            for t in plan.twins.get(r, []):
                cands[t].pruned = None
            plan.settle(r, estimate=est)


def _lower_bound(c: Candidate) -> int | None:
    """The need a lever showed ``c`` has at least (None: estimated, or not pruned so)."""
    if c.estimate.get("status") == "over_budget":
        return int(c.estimate["needed_at_least_bytes"])
    p = c.pruned or {}
    if p.get("reason") in ("no_fit", "parameters") and p.get("at_least_bytes") is not None:
        return int(p["at_least_bytes"])
    return None


def closest(cands: list[Candidate], budget: int, margin: float,
            k: int = 3) -> list[dict[str, Any]]:
    """The ``k`` candidates that came nearest the budget, and what would make them fit. A
    measured candidate is judged by its run (never "over by" a negative amount because its
    estimate fitted): its measured peak, or why its run gave none."""
    ok = sorted((c for c in cands if c.estimate.get("status") == "ok"),
                key=lambda c: _nearest_need(c))
    out = []
    for c in ok[:k]:
        measured = _measured_miss(c, budget)
        if measured is not None:
            out.append(measured)
            continue
        need, cats = c.estimate["needed_bytes"], c.estimate.get("by_category") or {}
        top = max(cats, key=cats.__getitem__) if cats else "?"
        advice = {
            "activations": "shorter sequences (method.max_length) or a smaller effective "
                           "batch; with --allow sharding the activations stay, the rest shrinks",
            "parameters": "--allow peft (LoRA / QLoRA: frozen or quantized base), --allow "
                          "sharding (FSDP2 / ZeRO-3 over several GPUs), or --allow precision",
            "optimizer": "--allow optimizer (8-bit AdamW: ~2 bytes of state a parameter "
                         "instead of 8), --allow peft (optimizer state for the adapter only) or "
                         "--allow sharding (ZeRO shards it)",
            "gradients": "train.max_grad_norm=null (then fit tries the step inside backward), "
                         "--allow peft or --allow sharding",
        }.get(top, "a larger card")
        out.append({"label": c.label, "overrides": c.overrides, "needed_bytes": need,
                    "over_by_bytes": int(need * (1 + margin)) - budget, "dominant": top,
                    "dominant_bytes": cats.get(top), "what_would_fit": advice})
    return out


def _nearest_need(c: Candidate) -> int:
    m = c.measured or {}
    if m.get("status") == "ok" and m.get("peak_bytes"):
        return int(m["peak_bytes"])
    return int(c.estimate["needed_bytes"])


def _measured_miss(c: Candidate, budget: int) -> dict[str, Any] | None:
    """Why a measured candidate is not the answer, as :func:`closest` lists it (None: it was
    not measured)."""
    m = c.measured
    if not m:
        return None
    peak = m.get("peak_bytes") if m.get("status") == "ok" else None
    if peak is not None and peak > budget:
        why = (f"its measured peak, {peak / 2**20:.1f} MiB, is over the budget by "
               f"{(peak - budget) / 2**20:.1f} MiB (the estimate was too low)")
    elif peak is not None:
        why = (f"its measured peak, {peak / 2**20:.1f} MiB, fits, but "
               f"{m.get('error') or 'its run has no tokens/s'}")
    else:
        why = f"its measured run ended {m.get('status')}: {m.get('error')}"
    return {"label": c.label, "overrides": c.overrides, "needed_bytes": peak,
            "over_by_bytes": None if peak is None else peak - budget,
            "dominant": None, "dominant_bytes": None, "what_would_fit": why,
            "run_dir": m.get("run_dir")}
