"""``memlab fit``: the fastest configuration that fits a memory budget, found and measured.

Usage::

    memlab fit --budget 24GiB method=dpo model=hf model.name_or_path=...   # search, measure
    memlab fit --card rtx4090 --allow peft,precision experiment=qwen2.5_0.5b_sft --estimate-only
    python -m memlab mode=fit --budget 120MiB                              # the same

The overrides fix what the user decided (model, method, data, max_length, the effective batch
``train.batch_size x train.grad_accum``, and any technique named on the command line); fit
searches the rest of the technique space (:mod:`.space`): gradient checkpointing (off, every
2nd layer, every layer), the micro-batch split of the same effective batch (or, without
clipping, one micro-batch stepped inside backward), padding-free, chunked loss, packing, and on
CUDA activation offloading and the attention backends; LoRA / QLoRA, mixed precision, sharding
and 8-bit / factored optimizer states only with ``--allow``. It estimates on fake tensors the
candidates that can change its answer (:mod:`.prune`: twins share an estimate, a micro-batch
that does not fit rules out larger ones, a dominated candidate is skipped, an estimate stops
once its need is past the budget, parameters too large for it rule out their candidates;
``--exhaustive`` estimates all), showing its progress (:mod:`.progress`), ranks those that fit (with
``--margin``) by a speed model, trains the best few for a few steps each in fresh processes and
picks the fastest whose *measured* peak fits (:mod:`.search`).

Writes into ``--out`` (default ``outputs/fit/<date>/<time>``): ``fit.json`` (every candidate:
estimated and measured peak, tokens/s with spread and timed steps, status, pruned / shared; the
winner; how well the speed model predicted the measured order; the search's counts; the command
line that reproduces the search), ``fit.csv`` (the same table, one row a candidate; the console
shows only the best few), the measured runs under ``runs/``, and the winner as ``experiment/fit.yaml``, runnable with
``memlab --config-dir <out> experiment=fit``. A budget nothing fits gets the closest candidates
and what would make them fit.

Candidates are estimated ``--jobs`` at a time (default: one per core), each in a worker
process. Ctrl-C, SIGTERM or SIGHUP stop the search (the workers, and the measured run in order:
it records what it measured), and ``fit.json`` is written with what was found so far,
``status: interrupted`` and no verdict; so it is when a measured run is interrupted or killed
from outside (an unfinished measurement is never taken for "does not fit"). Two searches never
share ``--out`` (a lock, :mod:`memlab.rundir`; the default is a new directory even within one
second).

Exit status: 0 a configuration was found, 1 nothing fits (or nothing measured fits), 2 invalid
command line or ``--out`` in use, 128 + the signal when interrupted (130: Ctrl-C, 143: SIGTERM;
a partial fit.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memlab.cli.fit.output import candidates_csv, format_table, search_record
from memlab.cli.fit.search import MEASURE_BUDGET_S, FitOptions
from memlab.cli.fit.space import ALLOWABLE, Candidate
from memlab.measure.console import printable


def build_parser() -> argparse.ArgumentParser:
    from memlab.estimate import CARDS

    p = argparse.ArgumentParser(
        prog="memlab fit", allow_abbrev=False,
        description="Find the fastest configuration whose peak memory fits a budget: estimate "
                    "every candidate, measure the best, keep the fastest that fits.",
        epilog="Every key=value argument is a Hydra override, fixed for every candidate.")
    p.add_argument("--budget", metavar="SIZE", help="memory per device, e.g. 24GiB, 120MiB")
    p.add_argument("--card", choices=sorted(CARDS), metavar="CARD",
                   help=f"a GPU: {', '.join(CARDS)} (budget = its memory; implies --device cuda)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the device of the estimates and the runs (default: cuda with --card, "
                        "else cpu)")
    p.add_argument("--allow", default="", metavar="LIST",
                   help=f"also search these, which change what or how it trains: "
                        f"{','.join(ALLOWABLE)}")
    p.add_argument("--margin", type=float, default=0.05,
                   help="safety margin on the estimate (0.05: estimate x 1.05 must fit)")
    p.add_argument("--measure", type=int, default=3, metavar="K",
                   help="candidates measured with real runs (default 3)")
    p.add_argument("--steps", type=int, default=10, metavar="N",
                   help="optimizer steps per measured run (default 10: the first two and every "
                        "step with a larger batch than before run under the memory tracker, "
                        "the others are timed)")
    p.add_argument("--measure-budget", type=float, default=MEASURE_BUDGET_S, metavar="S",
                   help="seconds of measured runs in all (default %(default).0f): after the "
                        "first runs, tied or untimed top candidates are measured again with "
                        "twice the steps while it lasts")
    p.add_argument("--estimate-only", action="store_true",
                   help="rank by the estimates, run nothing (no device needed)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="candidates estimated at a time, each in its own process (default: "
                        "the number of cores)")
    p.add_argument("--exhaustive", action="store_true",
                   help="estimate every candidate: no twin shares an estimate, none is pruned "
                        "(slower; the same fitting candidates, order and estimates)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="where fit.json, runs/ and experiment/fit.yaml go")
    p.add_argument("--json", action="store_true", help="print fit.json instead of the table")
    return p


def options(args) -> FitOptions:
    from memlab.estimate import CARDS, parse_bytes

    if args.budget is None and args.card is None:
        raise ValueError("give --budget SIZE or --card NAME")
    budget = (parse_bytes(args.budget) if args.budget
              else CARDS[args.card]["mib"] * 2**20)
    allow = tuple(a for a in args.allow.split(",") if a)
    bad = sorted(set(allow) - set(ALLOWABLE))
    if bad:
        raise ValueError(f"--allow {','.join(bad)}: choose from {','.join(ALLOWABLE)}")
    if (args.measure < 1 or args.steps < 3 or not 0 <= args.margin < 1 or args.jobs < 1
            or args.measure_budget < 0):
        raise ValueError("--measure >= 1, --steps >= 3 (warm-up, tracked and timed steps), "
                         "0 <= --margin < 1, --jobs >= 1 and --measure-budget >= 0")
    from memlab.estimate.options import device_of

    return FitOptions(budget_bytes=budget, device=device_of(args.device, args.card),
                      card=args.card, allow=allow, margin=args.margin, measure=args.measure,
                      steps=args.steps, estimate_only=args.estimate_only, jobs=args.jobs,
                      exhaustive=args.exhaustive, measure_budget_s=args.measure_budget)


def winner_yaml(base: list[str], cand: Candidate, cmd: str) -> str:
    """The winner as a ``conf/experiment`` file: group choices as defaults overrides, values as
    keys (the user's overrides first, then the candidate's)."""
    groups, values = {}, {}
    for o in [*base, *cand.overrides]:
        key, _, value = o.lstrip("+").partition("=")
        if "." in key:
            values[key] = value
        else:
            groups[key] = value
    lines = ["# @package _global_", f"# memlab fit's winner: {cand.label}", f"# found by: {cmd}"]
    if groups:
        lines.append("defaults:")
        lines += [f"  - override /{g}: {v}" for g, v in groups.items()]
    tree: dict[str, Any] = {}
    for key, value in values.items():
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value

    def emit(node: dict[str, Any], indent: int) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                lines.append(" " * indent + f"{k}:")
                emit(v, indent + 2)
            else:
                lines.append(" " * indent + f"{k}: {v}")

    emit(tree, 0)
    return "\n".join(lines) + "\n"


def fit(base: list[str], opts: FitOptions, out_dir: Path, argv: list[str],
        log=lambda m: print(m, file=sys.stderr, flush=True),
        tty: bool | None = None) -> dict[str, Any]:
    """Search, measure, choose; returns the ``fit.json`` record (also written to ``out_dir``)."""
    from memlab.cli.compose import compose
    from memlab.cli.fit import search, space
    from memlab.cli.fit.progress import Progress, stream_is_tty
    from memlab.cli.fit.prune import Plan
    from memlab.context import plain_config
    from memlab.measure.outcome import count_line
    from memlab.measure.summary import write_atomic, write_text_atomic

    t0 = time.perf_counter()
    cfg, choices = compose(base)
    plain = plain_config(cfg)
    dims, notes = space.dimensions(
        plain, opts.device, opts.allow, space.user_keys(base),
        precision=space.resolved_precision(choices.get("precision"), opts.device))
    cands = space.candidates(dims, plain, choices)
    plan = Plan(cands, dims, opts.device, prune=not opts.exhaustive,
                offload_configured=choices.get("offload", "none") != "none"
                and "offload" not in {d.name for d in dims},
                fits_below=search.fits_below(opts),
                params_bound=choices.get("distributed", "single") == "single"
                and "sharding" not in {d.name for d in dims})
    log(f"[fit] {len(cands)} candidates over {', '.join(d.name for d in dims) or 'nothing'}"
        + (f"; {len(plan.reps)} distinct estimates at most (twins share one)"
           if len(plan.reps) < len(cands) else "")
        + (f", {opts.jobs} estimated at a time" if opts.jobs > 1 else ""))
    configured = next((c for c in cands if not c.overrides or all(
        space._is_configured((o,), plain, choices) for o in c.overrides)), None)
    progress = Progress(opts.jobs, best=lambda cs: min(
        (c for c in cs if c.estimate.get("fits")), key=search.rank_key, default=None),
        stream=sys.stderr, tty=stream_is_tty() if tty is None else tty)
    ranked: list[Candidate] = []
    measured: list[Candidate] = []
    stopped: KeyboardInterrupt | None = None
    try:
        with _signals_interrupt():
            try:
                search.estimate_all(base, plan, opts, progress)
            finally:
                progress.finish()
            ranked = search.rank(cands)
            if not ranked and plan.prune:  # the closest as estimating every one finds them
                search.complete_closest(base, plan, opts)
            if ranked and not opts.estimate_only:
                baseline = configured if configured is not None and configured.estimate.get(
                    "fits") else None
                measured = search.measure(base, ranked, baseline, opts, out_dir, log)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM / SIGHUP, an unfinished measurement
        stopped = e
        log(f"[fit] {_why_stopped(e)}: writing what was found so far, no verdict")
        ranked = search.rank([c for c in cands if c.estimate])
        measured = [c for c in cands if c.measured]
    # a run with fewer than 3 timed steps (the others warm-up or tracked) is "not timed"
    fits = [c for c in measured if c.run().get("fits") and search.timed(c.run())]
    quality = search.prediction_quality(measured)
    best = search.fastest(fits, quality["checked"]) if stopped is None else None
    if best is None and opts.estimate_only and ranked and stopped is None:
        best = ranked[0]
    cmd = "memlab fit " + " ".join(shlex.quote(a) for a in argv)
    record: dict[str, Any] = {
        "kind": "fit", "status": "ok" if stopped is None else "interrupted",
        "interrupted": None if stopped is None else _why_stopped(stopped),
        "signal": None if stopped is None else _stop_signal(stopped),
        "command": cmd, "overrides": base, "budget_bytes": opts.budget_bytes,
        "device": opts.device, "card": opts.card, "allow": list(opts.allow),
        "margin": opts.margin, "measure": opts.measure, "steps": opts.steps,
        "estimate_only": opts.estimate_only,
        "space": [{"name": d.name, "exact": d.exact, "options": [lbl for lbl, _ in d.options]}
                  for d in dims],
        "notes": notes,
        "candidates": [{"label": c.label, "overrides": c.overrides, "exact": c.exact,
                        "configured": c is configured, "estimate": c.estimate,
                        "shared_with": c.shared, "pruned": c.pruned,
                        "predicted_rank": c.predicted_rank, "measured": c.measured}
                       for c in cands],
        "search": search_record(plan, opts, dims, notes),
        "prediction": quality, "measure_budget_s": opts.measure_budget_s,
        "winner": None, "nothing_fits": None,
    }
    if best is not None and stopped is None:
        run = " ".join(["memlab", *(shlex.quote(a) for a in [*base, *best.overrides])])
        yaml_path = out_dir / "experiment" / "fit.yaml"
        yaml_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(yaml_path, winner_yaml(base, best, cmd))
        record["winner"] = {"label": best.label, "overrides": best.overrides, "command": run,
                            "experiment": str(yaml_path),
                            "run_experiment": f"memlab --config-dir {out_dir} experiment=fit",
                            "exact": best.exact, "estimate": best.estimate,
                            "measured": best.measured,
                            "tied": search.ties(best, fits) if best.measured else None}
    elif stopped is None:
        record["nothing_fits"] = {
            "why": ("no candidate's estimate fits the budget" if not ranked else
                    "candidates estimated to fit, but none measured within the budget (measured "
                    + count_line(c.run()["status"] for c in measured) + ")"),
            "closest": search.closest(cands, opts.budget_bytes, opts.margin)}
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["csv"] = str(out_dir / "fit.csv")
    write_atomic(out_dir / "fit.json", record)
    write_text_atomic(out_dir / "fit.csv", candidates_csv(record))
    return record


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP raise :class:`~memlab.cli.fit.search.SearchInterrupted`
    (a KeyboardInterrupt) in the main thread for the block: fit stops its workers and its
    measured run, and writes a partial fit.json. SIGINT gets fit's own handler too, so Ctrl-C
    stops fit even in a process that inherited it ignored (seen: a test worker)."""
    import threading

    from memlab.cli.fit.search import SearchInterrupted

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    owner = os.getpid()

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a process forked inside the block (an estimating worker)
            os._exit(128 + signum)  # before it set its own handlers: end as the signal would
        name = signal.Signals(signum).name
        raise SearchInterrupted(f"stopped by {name}", name)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _stop_signal(e: BaseException) -> str:
    return str(getattr(e, "signal", None) or "SIGINT")


def _why_stopped(e: BaseException) -> str:
    return str(e) or "stopped by SIGINT (Ctrl-C)"


def main(argv: list[str] | None = None) -> int:
    """Run ``memlab fit``; see the module docstring for the exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        parser.print_usage(sys.stderr)
        print(f"memlab fit: unknown option(s) {' '.join(flags)}", file=sys.stderr)
        return 2
    from memlab.cli.overrides import too_deep

    deep = too_deep(rest)
    if deep is not None:
        print(f"memlab fit: {deep}", file=sys.stderr)
        return 2
    try:
        opts = options(args)
    except ValueError as e:
        print(f"memlab fit: {e}", file=sys.stderr)
        return 2
    from memlab import rundir

    out = args.out or Path("outputs") / "fit" / time.strftime("%Y-%m-%d") / time.strftime(
        "%H-%M-%S")
    try:  # one search per directory; the default is a new one (memlab.rundir)
        out = rundir.claim(out, fresh=args.out is None, kind="fit").path
    except rundir.DirInUse as e:
        print(f"memlab fit: --out {out.absolute()} is {e}; give another --out",
              file=sys.stderr)
        return 2
    try:
        record = fit(rest, opts, out, argv)
    except KeyboardInterrupt:  # before the search or while its record is written
        print("memlab fit: interrupted (Ctrl-C) before the search could record anything",
              file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bad override: Hydra's message, exit 2
        from memlab.registry import ConfigErrors

        if type(e).__module__.split(".")[0] not in ("hydra", "omegaconf") and not isinstance(
                e, ConfigErrors):
            raise
        print(f"memlab fit: {e}", file=sys.stderr)
        return 2
    finally:
        rundir.release("fit")
    print(json.dumps(record, indent=1, default=str) if args.json
          else printable(format_table(record), keep_newlines=True))
    print(f"\nwrote {out / 'fit.json'} (every candidate) and {out / 'fit.csv'}",
          file=sys.stderr)
    if record["status"] == "interrupted":
        return 128 + int(signal.Signals[record["signal"]])
    return 0 if record["winner"] else 1
