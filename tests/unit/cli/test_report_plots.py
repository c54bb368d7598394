"""``memlab report``'s plots tell their lines and points apart (issue 46 item 7): loss curves in
ten qualitative colours, then the same colours in the next line style; the throughput plot's
legend names each kind of point."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from memlab.cli.report import build_table, load_summaries


def _jobs(root: Path, n: int) -> Path:
    for num in range(n):
        overrides = [f"train.lr={num + 1}e-4"]
        s = {"status": "ok", "overrides": overrides, "choices": {"method": "sft"},
             "job": {"num": num}, "error": None,
             "memory": {"peak_bytes": (100 + 10 * num) * 2**20},
             "throughput": {"tokens_per_s": 1000.0 + (50 * num if num % 2 else -50 * num),
                            "tokens_per_s_std": 1.0, "timed_steps": 4},
             "train": {"final_loss": 2.0, "loss_curve": [3.0, 2.5 - num / 100, 2.0]}}
        job = root / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- {overrides[0]}\n")
        (job / "summary.json").write_text(json.dumps(s))
    return root


def test_twelve_loss_curves_are_told_apart(tmp_path: Path) -> None:
    """Eight curves (the issue's sweep) take eight distinct hues, far apart; curves 11 and 12
    reuse the first colours dashed; no two curves share colour and line style."""
    from matplotlib.colors import to_rgb

    from memlab.cli.report.plots import loss_curves_figure

    ax = loss_curves_figure(build_table(load_summaries([_jobs(tmp_path, 12)]))).axes[0]
    lines = ax.lines
    assert len(lines) == 12
    styles = [(ln.get_color(), ln.get_linestyle()) for ln in lines]
    assert len(set(styles)) == 12
    first = [to_rgb(ln.get_color()) for ln in lines[:10]]
    closest = min(sum((a - b) ** 2 for a, b in zip(p, q)) ** 0.5
                  for p, q in itertools.combinations(first, 2))
    assert closest > 0.25, closest  # (RGB distance; tab20, the palette before: 0.15)
    assert {ln.get_linestyle() for ln in lines[:10]} == {"-"}
    assert [ln.get_linestyle() for ln in lines[10:]] == ["--", "--"]
    assert [ln.get_color() for ln in lines[10:]] == [ln.get_color() for ln in lines[:2]]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == 12 and legend[0].startswith("#0 ")


def test_the_throughput_plot_legend_names_each_kind_of_point(tmp_path: Path) -> None:
    from memlab.cli.report.plots import memory_vs_throughput_figure

    df = build_table(load_summaries([_jobs(tmp_path, 4)]))
    assert 0 < df["pareto"].sum() < 4
    ax = memory_vs_throughput_figure(df).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sorted(legend) == ["Pareto front: best tokens/s within the memory", "a job",
                              "a job on the Pareto front"]
