"""``memlab fit``'s progress: a bar with an ETA and the best candidate so far.

On a terminal, one line redrawn in place (stderr)::

    [fit] [###.........] 104/432 settled: 40 estimated, 64 pruned, 40 shared | 1m20s so far, ETA ~2m10s (<= 5m40s) | best: no checkpointing, ... (5.52 GiB, 4.02 s/step)

Elsewhere (a log, a pipe), one line per estimate (``[fit] estimate k/n #i label: ...``, k
counting the estimates made) and the bar's text every ``every_s`` seconds. The ETA: the
candidates not yet settled, at the mean time of an estimate so far, ``jobs`` at a time, as many
of them estimated as of those settled so far (the others pruned); in brackets the most it can
be (every one estimated).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from memlab.cli.fit.prune import Plan
    from memlab.cli.fit.space import Candidate


def duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """What :func:`memlab.cli.fit.search.estimate_all` reports as it goes."""

    def __init__(self, jobs: int, best: Callable[[list[Candidate]], Candidate | None],
                 stream: TextIO | None = None, tty: bool | None = None,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.jobs = max(1, jobs)
        self.best = best
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self.clock = clock
        self.t0 = clock()
        self.last = -1e9
        self.made = 0
        self.seconds: list[float] = []
        self.drawn = False

    # ------------------------------------------------------------------ events
    def started(self, plan: Plan, i: int) -> None:
        self._draw(plan)

    def estimated(self, plan: Plan, i: int) -> None:
        c = plan.cands[i]
        est = c.estimate
        self.made += 1
        if self.made > 1:  # the first one warms the process up: not a typical estimate
            self.seconds.append(float(est.get("seconds") or 0.0))
        if not self.tty:
            need = est.get("needed_bytes")
            twins = len(plan.twins.get(i, []))
            self._line(f"[fit] estimate {self.made}/{len(plan.reps)} #{i} {c.label}: "
                       f"{est['status']}"
                       + (f", {need / 2**20:.1f} MiB" if need else f" ({est.get('error')})")
                       + (", fits" if est.get("fits") else "")
                       + (f" (also #{', #'.join(map(str, plan.twins[i]))})" if twins else "")
                       + f" ({est.get('seconds', 0.0):.1f} s)")
        self._draw(plan)

    def note(self, plan: Plan) -> None:
        """A candidate was pruned or shared."""
        self._draw(plan, quiet=True)

    def tick(self, plan: Plan) -> None:
        self._draw(plan)

    def finish(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False

    # ------------------------------------------------------------------ text
    def eta_s(self, plan: Plan) -> tuple[float, float] | None:
        """(projected, at most) seconds left: the candidates not yet settled at the mean time
        of an estimate, ``jobs`` at a time; projected, as many of them estimated as of those
        settled so far (the others pruned)."""
        left = len(plan.reps) - len(plan.done)
        if not self.seconds or not plan.done:
            return None
        most = left * (sum(self.seconds) / len(self.seconds)) / self.jobs
        share = sum(1 for i in plan.done if plan.cands[i].estimate) / len(plan.done)
        return most * share, most

    def text(self, plan: Plan, width: int = 100) -> str:
        counts = plan.counts()
        total = len(plan.reps)
        settled = len(plan.done)
        bar_w = 12
        filled = int(bar_w * settled / total) if total else bar_w
        eta = self.eta_s(plan)
        parts = [f"[fit] [{'#' * filled}{'.' * (bar_w - filled)}] {settled}/{total} settled: "
                 f"{counts['estimated']} estimated"
                 + (f" (+{counts['stopped']} stopped over the budget)" if counts["stopped"]
                    else "")
                 + f", {counts['no_fit'] + counts['parameters'] + counts['dominated']} pruned"
                 + (f", {counts['shared']} shared" if counts["shared"] else ""),
                 f"{duration(self.clock() - self.t0)} so far"
                 + (f", ETA ~{duration(eta[0])} (<= {duration(eta[1])})" if eta else "")]
        best = self.best(plan.cands)
        if best is not None:
            e: dict[str, Any] = best.estimate
            parts.append(f"best: {best.label} ({e['needed_bytes'] / 2**30:.2f} GiB"
                         + (f", {e['predicted_s']:.3g} s/step" if e.get("predicted_s") else "")
                         + ")")
        line = " | ".join(parts)
        return line if len(line) <= width else line[: width - 3] + "..."

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _draw(self, plan: Plan, quiet: bool = False) -> None:
        now = self.clock()
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r\x1b[K" + self.text(plan, width))
            self.stream.flush()
            self.drawn = True
        elif not quiet and now - self.last >= self.every_s:
            self.last = now
            self._line(self.text(plan, 10**6))


def stream_is_tty() -> bool:
    """Whether stderr is a terminal a bar may redraw (not ``TERM=dumb``)."""
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
