"""How fit judges speed: only from timed steps (>= 3), a difference only beyond the larger of
two spreads (the rule fit shares with ``memlab report``: :mod:`memlab.measure.speed`), the
speed model breaking a tie only once it has been checked on enough measured candidates; the
rank correlation that checks it (:mod:`memlab.cli.fit.search` re-exports these)."""

from __future__ import annotations

from typing import Any

from memlab.cli.fit.runs import UNFINISHED, SearchInterrupted
from memlab.cli.fit.space import Candidate
from memlab.measure import speed
from memlab.measure.speed import MIN_TIMED

MIN_MODEL_POINTS = 5
"""Measured candidates the speed model's order must be checked on before it breaks a measured
tie or is called worse than chance (with 3, a rank correlation of -0.5 happens one time in
three by chance)."""


def padded(c: Candidate) -> int:
    """1 where the speed model counts ``c``'s rows as padded (unpacked, not padding-free)."""
    return int("method.padding_free=false" in c.overrides and "packing=bfd_split"
               not in c.overrides)


def micro_batches(c: Candidate) -> int:
    """The micro-batches a step of ``c`` (``train.grad_accum``), a key of the speed model."""
    for o in c.overrides:
        if o.startswith("train.grad_accum="):
            return int(o.split("=", 1)[1])
    return 1


def score(c: Candidate) -> tuple[float, int, int]:
    """The speed model: smaller is faster (:func:`predicted_seconds` to 3 significant digits,
    micro-batches per step, padded)."""
    t = c.estimate.get("predicted_s") or 0.0
    return (float(f"{t:.3g}"), micro_batches(c), padded(c))


def timed(m: dict[str, Any]) -> bool:
    """Whether a measured run's tokens/s may be ranked: at least :data:`MIN_TIMED` timed
    steps."""
    return speed.timed(m.get("tokens_per_s"), m.get("timed_steps"))


def contenders(done: list[Candidate]) -> list[Candidate]:
    """The fitting measured candidates worth measuring again: the fastest and those tied with
    it (within the larger of the two spreads), when there is a tie, plus those not timed."""
    fits = [c for c in done if c.measured and c.run().get("fits")]
    untimed = [c for c in fits if c.run()["status"] == "ok" and not timed(c.run())]
    ranked = [c for c in fits if timed(c.run())]
    if not ranked:
        return untimed
    top = max(ranked, key=lambda c: c.run()["tokens_per_s"])
    tied = [c for c in ranked if c is not top and _tied(top.run(), c.run())]
    return ([top, *tied] if tied else []) + untimed


def _tied(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two measured runs whose tokens/s differ by no more than the larger of their spreads."""
    return speed.tied(a["tokens_per_s"], a.get("tokens_per_s_std"),
                      b["tokens_per_s"], b.get("tokens_per_s_std"))


def judge(c: Candidate, budget: int) -> None:
    """Whether the measured ``c`` fits; a run stopped from outside is no measurement: the search
    stops (:class:`SearchInterrupted`)."""
    m = c.run()
    m["fits"] = bool(m["status"] == "ok" and m.get("peak_bytes") and m["peak_bytes"] <= budget)
    if m["status"] == "ok" and not timed(m):
        m["error"] = (f"not timed: {m.get('timed_steps') or 0} timed step(s), fewer than "
                      f"{MIN_TIMED} (the others were warm-up or tracked): raise --steps")
    if m["status"] in UNFINISHED:
        raise SearchInterrupted(
            f"the measured run of {c.label} ({m['run_dir']}) was {m['status']} from outside "
            f"({m.get('error')}); no verdict from an unfinished measurement",
            m.get("signal") or ("SIGKILL" if m["status"] == "killed" else "SIGTERM"))


def fastest(fits: list[Candidate], model_checked: bool = False) -> Candidate | None:
    """The winner among measured candidates that fit and are timed (:func:`timed`): the
    fastest; others within the measured spread of it (the larger std of the two runs' timed
    steps) are a tie the measurement cannot order. The speed model's order breaks it only when
    ``model_checked`` (it ordered at least :data:`MIN_MODEL_POINTS` measured candidates better
    than chance); otherwise the smaller measured peak, then the higher measured mean, does
    (:func:`ties` says the winner is tied)."""
    fits = [c for c in fits if timed(c.run())]
    if not fits:
        return None
    top = max(fits, key=lambda c: c.run()["tokens_per_s"])
    tied = [c for c in fits if c is top or _tied(top.run(), c.run())]
    if model_checked:
        return min(tied, key=lambda c: (c.predicted_rank or 10**9, c.run()["peak_bytes"]))
    return min(tied, key=lambda c: (c.run()["peak_bytes"], -c.run()["tokens_per_s"]))


def ties(winner: Candidate, fits: list[Candidate]) -> dict[str, Any] | None:
    """The measured candidates tied with ``winner`` (within the larger spread), and the largest
    gap as a share of the winner's tokens/s: "tied within X%"."""
    others = [c for c in fits if c is not winner and timed(c.run())
              and _tied(winner.run(), c.run())]
    if not others:
        return None
    t = winner.run()["tokens_per_s"]
    gap = max(abs(c.run()["tokens_per_s"] - t) for c in others) / t
    spread = max(max(c.run().get("tokens_per_s_std") or 0.0 for c in others),
                 winner.run().get("tokens_per_s_std") or 0.0) / t
    return {"with": [c.label for c in others], "within_pct": round(100 * max(gap, spread), 1)}


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None under 3 points."""
    if len(xs) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return None if not vx or not vy else cov / (vx * vy)


def prediction_quality(measured: list[Candidate]) -> dict[str, Any]:
    """How well the predicted order matched the measured tokens/s (higher rank = slower), over
    the timed runs; ``checked``: over at least :data:`MIN_MODEL_POINTS` of them and better than
    chance (then it may break a measured tie: :func:`fastest`)."""
    pts = [(score(c), c.measured["tokens_per_s"]) for c in measured
           if c.predicted_rank is not None and c.measured and c.measured["status"] == "ok"
           and timed(c.measured)]
    order = sorted({p for p, _ in pts})
    rho = spearman([-order.index(p) for p, _ in pts], [t for _, t in pts])
    checked = rho is not None and len(pts) >= MIN_MODEL_POINTS and rho > 0
    if len(pts) < MIN_MODEL_POINTS:
        note = (f"{len(pts)} timed candidate(s), fewer than {MIN_MODEL_POINTS}: no verdict on "
                "the speed model, which breaks no measured tie (with 3, a rank correlation of "
                "-0.5 happens one time in three by chance)")
    elif rho is None:
        note = "the speed model ranks every measured candidate the same"
    else:
        note = (f"Spearman's rho {rho:+.2f} over {len(pts)} timed candidates between the speed "
                "model's order and the measured tokens/s: "
                + ("better than chance" if rho > 0 else "no better than chance"))
    return {"spearman": rho, "points": len(pts), "classes": len(order), "checked": checked,
            "note": note}
