"""What ``memlab fit`` shows and writes besides ``fit.json``: the console summary (the best few
candidates, what was pruned and why, where the full table is), ``fit.csv`` (one row per
candidate) and ``fit.json``'s ``search`` section (what each lever of :mod:`.prune` saved)."""

from __future__ import annotations

import csv
import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memlab.cli.fit.prune import Plan
    from memlab.cli.fit.search import FitOptions
    from memlab.cli.fit.space import Dimension

SHOWN = 5
"""Candidates of the predicted ranking the console lists (fit.json and fit.csv have all)."""


def search_record(plan: Plan, opts: FitOptions, dims: list[Dimension],
                  notes: list[str]) -> dict[str, Any]:
    """``fit.json``'s ``search``: candidates estimated, sharing an estimate, pruned (by
    reason), and the estimates each lever avoided."""
    counts = plan.counts()
    pruned_reps = {"no_fit": 0, "parameters": 0, "dominated": 0}
    dominated_by = {"checkpointing": 0, "micro_batch": 0, "padding_free": 0}
    for r in plan.reps:
        why = plan.cands[r].pruned
        if why:
            pruned_reps[why["reason"]] += 1
            if why["reason"] == "dominated":
                dominated_by[why.get("lever", "checkpointing")] += 1
    precision_twins = any(n.startswith("precision: not searched") for n in notes)
    made = [c.estimate for c in plan.cands if c.estimate and c.shared is None]
    seconds = [float(e.get("seconds") or 0.0) for e in made]
    stopped = [e for e in made if e.get("status") == "over_budget"]
    return {
        "exhaustive": opts.exhaustive, "counts": counts,
        "distinct_estimates": len(plan.reps), "estimates_made": len(seconds),
        "made": plan.made,
        "estimate_s": round(sum(seconds), 1),
        "estimate_cpu_s": round(sum(float(e.get("cpu_s") or 0.0) for e in made), 1),
        "stopped_cpu_s": round(sum(float(e.get("cpu_s") or 0.0) for e in stopped), 1),
        "avoided": {
            "precision_twins": len(plan.cands) if precision_twins else 0,
            "attention_twins": len(plan.cands) - len(plan.reps),
            "no_fit": pruned_reps["no_fit"], "parameters": pruned_reps["parameters"],
            "dominated": pruned_reps["dominated"], "dominated_by": dominated_by,
            "stopped": len(stopped)},
        "why": {
            "precision_twins": "candidates never formed: --allow precision's option is the "
                               "configuration itself",
            "attention_twins": "estimates shared: attention backends the estimate runs alike "
                               "on the target (shared_with)",
            "no_fit": "not estimated: a smaller micro-batch of the same settings does not fit",
            "parameters": "not estimated: its parameters alone (as a candidate with the same "
                          "weights estimated them) need more than fits",
            "stopped": "estimated in part: stopped once a tracked moment showed its need is "
                       "more than fits (needed_at_least_bytes; stopped_cpu_s in all)",
            "dominated": "not estimated: the same candidate with less checkpointing and no "
                         "offloading, one micro-batch a step, or padding-free rows "
                         "(dominated_by, estimates avoided by each) fits and is predicted no "
                         "slower, ranked first"},
    }


def _mib(b: Any) -> Any:
    return None if b is None else round(b / 2**20, 1)


def candidates_csv(record: dict[str, Any]) -> str:
    """Every candidate of ``record`` as CSV (spreadsheet-safe cells)."""
    from memlab.measure.console import csv_cell

    cols = ["index", "label", "configured", "exact", "status", "pruned", "pruned_by",
            "shared_with", "needed_MiB", "fits", "predicted_s", "predicted_rank",
            "measured_status", "measured_peak_MiB", "tokens_per_s", "tokens_per_s_std",
            "timed_steps", "overrides"]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(cols)
    for i, c in enumerate(record["candidates"]):
        e, m, p = c["estimate"] or {}, c["measured"] or {}, c.get("pruned") or {}
        row = [i, c["label"], c["configured"], c["exact"], e.get("status"), p.get("reason"),
               p.get("by"), c.get("shared_with"), _mib(e.get("needed_bytes")), e.get("fits"),
               e.get("predicted_s"), c["predicted_rank"], m.get("status"),
               _mib(m.get("peak_bytes")), m.get("tokens_per_s"), m.get("tokens_per_s_std"),
               m.get("timed_steps"), " ".join(c["overrides"])]
        w.writerow([csv_cell(v) for v in row])
    return buf.getvalue()


def _tps(m: dict[str, Any]) -> str:
    if not m:
        return "-"
    if not m.get("tokens_per_s"):
        return "not timed"
    steps = m.get("timed_steps")
    if steps is not None and steps < 3:
        return f"not timed ({steps} step{'s' if steps != 1 else ''})"
    return f"{m['tokens_per_s']:.0f} ± {m.get('tokens_per_s_std') or 0:.0f}"


def format_table(record: dict[str, Any]) -> str:
    """The console summary of a search (the full table: fit.json, fit.csv)."""
    from memlab.estimate import fmt_bytes

    cands = record["candidates"]
    lines = [f"memlab fit: budget {fmt_bytes(record['budget_bytes'])} on {record['device']}"
             + (f" ({record['card']})" if record["card"] else "")
             + f", margin {record['margin']:.0%}"]
    lines += [f"  {n}" for n in record["notes"]]
    shown = sorted((i for i, c in enumerate(cands) if c["predicted_rank"]),
                   key=lambda i: cands[i]["predicted_rank"])[:SHOWN]
    shown += [i for i, c in enumerate(cands) if (c["measured"] or c["configured"])
              and i not in shown]
    if shown:
        lines.append(f"{'#':>4}  {'estimated':>11}  {'fits':>4}  {'pred':>4}  {'measured':>11}  "
                     f"{'tokens/s':>15}  status  candidate")
    for i in shown:
        c = cands[i]
        e, m = c["estimate"] or {}, c["measured"] or {}
        status = m.get("status") or e.get("status") or (c.get("pruned") or {}).get(
            "reason") or "-"
        lines.append(f"{i:>4}  {fmt_bytes(e.get('needed_bytes')):>11}  "
                     f"{'yes' if e.get('fits') else 'no':>4}  "
                     f"{c['predicted_rank'] or '-':>4}  {fmt_bytes(m.get('peak_bytes')):>11}  "
                     f"{_tps(m):>15}  {status:<6}  {c['label']}"
                     + ("  [as configured]" if c["configured"] else ""))
    fitting = sum(1 for c in cands if c["predicted_rank"])
    if fitting > len([i for i in shown if cands[i]["predicted_rank"]]):
        lines.append(f"      ... {fitting} candidates fit in all (ranked in fit.json / fit.csv)")
    s = record.get("search")
    if s:
        n = s["counts"]
        parts = [f"{n['estimated']} estimated"]
        if n["shared"]:
            parts.append(f"{n['shared']} shared a twin's estimate")
        if n.get("stopped"):
            parts.append(f"{n['stopped']} stopped over the budget (estimated in part)")
        if n["no_fit"]:
            parts.append(f"{n['no_fit']} pruned: a smaller micro-batch does not fit")
        if n.get("parameters"):
            parts.append(f"{n['parameters']} pruned: the parameters alone do not fit")
        if n["dominated"]:
            by = (s.get("avoided") or {}).get("dominated_by") or {}
            how = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in by.items() if v)
            parts.append(f"{n['dominated']} pruned: dominated (a candidate with less "
                         "checkpointing / no offloading, one micro-batch a step or padding-free "
                         "fits, predicted no slower" + (f"; by {how}" if how else "") + ")")
        if n["left"]:
            parts.append(f"{n['left']} not reached")
        lines.append(f"search: {n['candidates']} candidates; " + "; ".join(parts)
                     + f" ({s['estimate_s']:.0f} s of estimates)")
    p = record["prediction"]
    if p.get("note") and p["points"]:
        lines.append(f"speed model vs measured: {p['note']}")
    w = record["winner"]
    if record.get("interrupted"):
        done = sum(1 for c in cands if c["estimate"])
        ran = sum(1 for c in cands if c["measured"])
        lines += ["", f"interrupted: {record['interrupted']}; {done} of {len(cands)} "
                      f"candidates estimated, {ran} measured; no verdict (the best so far "
                      "above)"]
    elif w:
        how = "measured" if w["measured"] else "estimated (not measured: --estimate-only)"
        lines += ["", f"winner ({how}): {w['label']}", f"  {w['command']}",
                  f"  or: {w['run_experiment']}"]
        tied = w.get("tied")
        if tied:
            lines.append(f"  tied within {tied['within_pct']}% with {', '.join(tied['with'])} "
                         "(measured tokens/s within the spread; "
                         + ("the speed model's order decided)" if p.get("checked") else
                            "the smaller measured peak, then the higher mean, decided)"))
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
