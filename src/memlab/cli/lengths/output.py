"""The output of ``memlab lengths``: the table and the histogram plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from memlab.cli.lengths.stats import PERCENTILES
from memlab.measure.summary import unlink_link


def plot(result: dict[str, Any], lengths: np.ndarray, path: Path, title: str = "") -> Path:
    """Log-x histogram of the lengths, the tokens truncated as a function of max_length (right
    axis) and a vertical line at every candidate (solid: the recommendation)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    h = result["histogram"]
    edges, counts = np.asarray(h["bin_edges"]), np.asarray(h["counts"])
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4C72B0", alpha=0.75,
           edgecolor="white", linewidth=0.4, label="examples")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per example (log scale)")
    ax.set_ylabel("examples")
    ax.grid(alpha=0.25, which="both", axis="x")

    # Fraction of all tokens beyond x, for x over the plotted range.
    s = np.sort(np.asarray(lengths, dtype=np.int64))
    suffix = np.concatenate([np.cumsum(s[::-1])[::-1], [0]])
    cands = [r["max_length"] for r in result["candidates"]]
    lo = max(1.0, min(float(edges[0]), min(cands, default=edges[0]) / 1.2))
    hi = max(float(edges[-1]), max(cands, default=edges[-1])) * 1.5
    xs = np.geomspace(lo, hi, 300)
    k = np.searchsorted(s, xs, side="right")
    lost = (suffix[k] - xs * (s.size - k)) / max(1, s.sum())
    ax2 = ax.twinx()
    ax2.plot(xs, np.clip(lost, 0, 1), color="#C44E52", lw=1.6,
             label="tokens truncated at max_length = x")
    ax2.set_ylabel("fraction of tokens truncated", color="#C44E52")
    ax2.set_ylim(0, 1.02)
    ax.set_xlim(lo, hi)

    rec = result["recommended"]["max_length"]
    for r in result["candidates"]:
        c = r["max_length"]
        best = c == rec
        ax.axvline(c, color="#2ca02c" if best else "#555555", lw=2.0 if best else 0.9,
                   ls="-" if best else "--", alpha=0.9)
        ax.annotate(f"{c}" + (" *" if best else "") + f"\n{r['tokens_truncated_frac']:.1%}",
                    (c, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -4),
                    textcoords="offset points", va="top", ha="left", fontsize=7,
                    color="#2ca02c" if best else "#333333")
    st = result["stats"]
    text = (f"n={st['count']}  p50={st['p50']}  p90={st['p90']}  p99={st['p99']}  "
            f"max={st['max']}  mean={st['mean']:.0f}")
    if rec is not None:
        text += f"\nrecommended max_length={rec} (<= {result['max_truncated']:.1%} tokens cut)"
    ax.set_title((title + "\n" if title else "") + text, fontsize=9)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [str(hd.get_label()) for hd in handles], loc="center right", fontsize=8)
    fig.tight_layout()
    unlink_link(path)  # a link there is replaced, never followed
    fig.savefig(path)
    return path


def _fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_table(result: dict[str, Any]) -> str:
    """Percentiles, the candidate table and the recommendation as plain text."""
    keys = [f"p{q}" for q in PERCENTILES] + ["max", "mean", "count", "total_tokens"]
    named = [("total", result["stats"])] + list(result["parts"].items())
    head = ["tokens"] + keys
    body = [[name] + [(f"{st[k]:.1f}" if k == "mean" else str(st[k])) for k in keys]
            for name, st in named]
    lines = _grid(head, body)
    lines.append("")
    b = result["batch_size"]
    head = ["max_length", "tokens_cut", "examples_cut", f"padding@bs{b}", "bfd_fill", "bfd_rows"]
    rec = result["recommended"]["max_length"]
    body = []
    for r in result["candidates"]:
        body.append([f"{r['max_length']}{' *' if r['max_length'] == rec else ''}",
                     _fmt_pct(r["tokens_truncated_frac"]), _fmt_pct(r["examples_truncated_frac"]),
                     _fmt_pct(r["padding_frac"]), _fmt_pct(r["packed_fill"]),
                     "-" if r["packed_rows"] is None else str(r["packed_rows"])])
    lines += _grid(head, body)
    lines.append("")
    if result["packing"]["note"]:
        lines.append(f"note: {result['packing']['note']}")
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    r = result["recommended"]
    lines.append(f"recommended max_length: {r['max_length'] if r['max_length'] else '-'}")
    lines.append(f"  {r['reason']}")
    if r.get("padding"):
        lines.append(f"  {r['padding']}")
    return "\n".join(lines)


def _grid(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(head[i]), *(len(row[i]) for row in body)) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths)),
            *(fmt.format(*row) for row in body)]

