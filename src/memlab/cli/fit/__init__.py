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
and 8-bit / factored optimizer states only with ``--allow``. It estimates every candidate on fake
tensors, ranks those that fit (with ``--margin``) by a speed model, trains the best few for a few
steps each in fresh processes and picks the fastest whose *measured* peak fits
(:mod:`.search`).

Writes into ``--out`` (default ``outputs/fit/<date>/<time>``): ``fit.json`` (every candidate:
estimated and measured peak, tokens/s with spread, status; the winner; how well the speed model
predicted the measured order; the command line that reproduces the search), the measured runs
under ``runs/``, and the winner as ``experiment/fit.yaml``, runnable with
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

from memlab.cli.fit.search import FitOptions
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
    p.add_argument("--steps", type=int, default=6, metavar="N",
                   help="optimizer steps per measured run (default 6: the first two and every "
                        "step with a larger batch than before run under the memory tracker, "
                        "the others are timed)")
    p.add_argument("--estimate-only", action="store_true",
                   help="rank by the estimates, run nothing (no device needed)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="candidates estimated at a time, each in its own process (default: "
                        "the number of cores)")
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
    if args.measure < 1 or args.steps < 3 or not 0 <= args.margin < 1 or args.jobs < 1:
        raise ValueError("--measure >= 1, --steps >= 3 (warm-up, tracked and timed steps), "
                         "0 <= --margin < 1 and --jobs >= 1")
    from memlab.estimate.options import device_of

    return FitOptions(budget_bytes=budget, device=device_of(args.device, args.card),
                      card=args.card, allow=allow, margin=args.margin, measure=args.measure,
                      steps=args.steps, estimate_only=args.estimate_only, jobs=args.jobs)


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
        log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Search, measure, choose; returns the ``fit.json`` record (also written to ``out_dir``)."""
    from memlab.cli.compose import compose
    from memlab.cli.fit import search, space
    from memlab.context import plain_config
    from memlab.measure.outcome import count_line
    from memlab.measure.summary import write_atomic, write_text_atomic

    t0 = time.perf_counter()
    cfg, choices = compose(base)
    plain = plain_config(cfg)
    dims, notes = space.dimensions(plain, opts.device, opts.allow, space.user_keys(base))
    cands = space.candidates(dims, plain, choices)
    log(f"[fit] {len(cands)} candidates over {', '.join(d.name for d in dims) or 'nothing'}"
        + (f", {opts.jobs} estimated at a time" if opts.jobs > 1 else ""))
    configured = next((c for c in cands if not c.overrides or all(
        space._is_configured((o,), plain, choices) for o in c.overrides)), None)
    ranked: list[Candidate] = []
    measured: list[Candidate] = []
    stopped: KeyboardInterrupt | None = None
    try:
        with _signals_interrupt():
            search.estimate_all(base, cands, opts, log)
            ranked = search.rank(cands)
            if ranked and not opts.estimate_only:
                baseline = configured if configured is not None and configured.estimate.get(
                    "fits") else None
                measured = search.measure(base, ranked, baseline, opts, out_dir, log)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM / SIGHUP, an unfinished measurement
        stopped = e
        log(f"[fit] {_why_stopped(e)}: writing what was found so far, no verdict")
        ranked = search.rank([c for c in cands if c.estimate])
        measured = [c for c in cands if c.measured]
    # a run whose every step was warm-up or tracked has no tokens/s: it cannot be ranked
    fits = [c for c in measured if c.run().get("fits") and c.run().get("tokens_per_s")]
    best = search.fastest(fits) if stopped is None else None
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
                        "predicted_rank": c.predicted_rank, "measured": c.measured}
                       for c in cands],
        "prediction": search.prediction_quality(measured),
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
                            "measured": best.measured}
    elif stopped is None:
        record["nothing_fits"] = {
            "why": ("no candidate's estimate fits the budget" if not ranked else
                    "candidates estimated to fit, but none measured within the budget (measured "
                    + count_line(c.run()["status"] for c in measured) + ")"),
            "closest": search.closest(cands, opts.budget_bytes, opts.margin)}
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    write_atomic(out_dir / "fit.json", record)
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

    def stop(signum: int, frame: Any) -> None:
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


def format_table(record: dict[str, Any]) -> str:
    from memlab.estimate import fmt_bytes

    lines = [f"memlab fit: budget {fmt_bytes(record['budget_bytes'])} on {record['device']}"
             + (f" ({record['card']})" if record["card"] else "")
             + f", margin {record['margin']:.0%}"]
    lines += [f"  {n}" for n in record["notes"]]
    lines.append(f"{'#':>3}  {'estimated':>11}  {'fits':>4}  {'pred':>4}  {'measured':>11}  "
                 f"{'tokens/s':>15}  status  candidate")
    for i, c in enumerate(record["candidates"]):
        e, m = c["estimate"], c["measured"] or {}
        tps = (f"{m['tokens_per_s']:.0f} ± {m.get('tokens_per_s_std') or 0:.0f}"
               if m.get("tokens_per_s") else "-")
        status = m.get("status") or e.get("status") or "-"
        lines.append(f"{i:>3}  {fmt_bytes(e.get('needed_bytes')):>11}  "
                     f"{'yes' if e.get('fits') else 'no':>4}  "
                     f"{c['predicted_rank'] or '-':>4}  {fmt_bytes(m.get('peak_bytes')):>11}  "
                     f"{tps:>15}  {status:<6}  {c['label']}"
                     + ("  [as configured]" if c["configured"] else ""))
    p = record["prediction"]
    if p["spearman"] is not None:
        lines.append(f"speed model vs measured order: Spearman {p['spearman']:+.2f} over "
                     f"{p['points']} runs")
    w = record["winner"]
    if record.get("interrupted"):
        done = sum(1 for c in record["candidates"] if c["estimate"])
        ran = sum(1 for c in record["candidates"] if c["measured"])
        lines += ["", f"interrupted: {record['interrupted']}; {done} of "
                      f"{len(record['candidates'])} candidates estimated, {ran} measured; no "
                      "verdict"]
    elif w:
        how = "measured" if w["measured"] else "estimated (not measured: --estimate-only)"
        lines += ["", f"winner ({how}): {w['label']}", f"  {w['command']}",
                  f"  or: {w['run_experiment']}"]
    else:
        nf = record["nothing_fits"]
        lines += ["", f"nothing fits: {nf['why']}; the closest:"]
        for c in nf["closest"]:
            if c.get("dominant") is None:  # judged by its measured run
                lines.append(f"  {c['label']}: {c['what_would_fit']}")
                continue
            lines.append(f"  {c['label']}: needs {fmt_bytes(c['needed_bytes'])} (over by "
                         f"{fmt_bytes(c['over_by_bytes'])}; {c['dominant']} "
                         f"{fmt_bytes(c['dominant_bytes'])}): {c['what_would_fit']}")
    return "\n".join(lines)


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
    print(f"\nwrote {out / 'fit.json'}", file=sys.stderr)
    if record["status"] == "interrupted":
        return 128 + int(signal.Signals[record["signal"]])
    return 0 if record["winner"] else 1
