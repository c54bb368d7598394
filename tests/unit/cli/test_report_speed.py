"""``memlab report`` judges speed only where it was measured (issue 45 item 4), by the rule
``memlab fit`` uses (:mod:`memlab.measure.speed`): a job timed on fewer than 3 steps is "not
timed": its tokens/s is shown (marked) but it is not the fastest, not on the Pareto front (table
and plot), has no change against a baseline and sorts last by speed; two jobs within the larger
of their spreads are not ranked apart (the fastest names them tied; a change between them is
said to be within the spread)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memlab.cli.report import add_baseline, build_table, load_summaries, main, sort_table
from memlab.cli.report.text import format_text

MIB = 2**20

# job: (peft, gradient checkpointing, peak MiB, tokens/s, its spread, timed steps)
JOBS = {
    0: ("none", "false", 100, 1000.0, 5.0, 10),   # the fastest timed job ...
    1: ("lora", "false", 60, 990.0, 15.0, 10),    # ... tied with this one (10 < 15): on the front
    2: ("lora", "true", 50, 5000.0, 1.0, 2),      # the most tokens/s, from 2 timed steps
    3: ("none", "true", 80, 700.0, 5.0, 10),      # slower, more memory than job 1
}


def _summary(num: int) -> dict[str, Any]:
    peft, gc, peak_mib, tps, std, steps = JOBS[num]
    peak = peak_mib * MIB
    cats = {"parameters": peak // 4, "gradients": peak // 4, "optimizer": peak // 4}
    cats["activations"] = peak - sum(cats.values())
    return {
        "status": "ok", "error": None, "choices": {"method": "sft", "peft": peft},
        "overrides": [f"peft={peft}", f"train.gradient_checkpointing={gc}"],
        "job": {"name": "train", "num": num}, "run_dir": f"/sweep/{num}",
        "memory": {"peak_bytes": peak, "by_category": cats},
        "throughput": {"tokens_per_s": tps, "tokens_per_s_std": std, "timed_steps": steps,
                       "samples_per_s": tps / 64, "step_time_s": 0.1, "tokens": 6400},
        "train": {"final_loss": 2.0, "loss_curve": [3.0, 2.0]},
    }


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "multirun"
    for num in JOBS:
        s = _summary(num)
        job = root / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in s["overrides"]))
        (job / "summary.json").write_text(json.dumps(s))
    return root


def _row(text: str, job: str) -> str:
    return next(line for line in text.splitlines() if line.split()[:1] == [job])


def test_a_job_timed_on_two_steps_is_not_ranked(sweep: Path) -> None:
    df = build_table(load_summaries([sweep]))
    assert df.attrs["untimed"] == ["2"]
    assert df.attrs["fastest"] == {"job": "0", "tokens_per_s": 1000.0, "tied": ["1"]}
    # without the rule job 2 (least memory, 5x the tokens/s) would be the whole front
    assert df.set_index("job")["pareto"].to_dict() == {"0": False, "1": True, "2": False,
                                                        "3": False}
    text = format_text(df, width=None)
    row = _row(text, "2")
    assert "not timed" in row and "5000.0!" in row and "2!" in row.split()
    assert "fastest: job 0 (1000.0 tokens/s), tied with job(s) 1" in text
    assert "not timed: job(s) 2 (fewer than 3 timed steps" in text
    # a sort by speed ranks the timed jobs and puts job 2 with the blanks, either way
    assert list(sort_table(df, "tokens_per_s", desc=True)["job"]) == ["0", "1", "3", "2"]
    assert list(sort_table(df, "tps")["job"]) == ["3", "1", "0", "2"]


def test_baseline_changes_need_both_jobs_timed_and_beyond_the_spread(sweep: Path) -> None:
    df = build_table(load_summaries([sweep]))
    against_0 = add_baseline(df, ["peft=none", "train.gradient_checkpointing=false"])
    d = against_0.set_index("job")["d_tokens_per_s_pct"]
    assert d["3"] == pytest.approx(-30.0) and d["1"] == pytest.approx(-1.0)
    assert d.isna()["2"]  # no number to rank
    base = against_0.attrs["baseline"]
    assert base["untimed"] == ["2"] and base["noisy"] == ["1"]  # 1: within 15 tokens/s
    text = format_text(against_0)
    assert _row(text, "2").endswith("not timed")  # d_tokens_per_s_pct, the last column
    assert "~ job(s) 1: the tokens/s change is within the larger of the two jobs' spreads" in text
    against_2 = add_baseline(df, "2")  # an untimed baseline: no speed change at all
    assert against_2["d_tokens_per_s_pct"].isna().all()
    assert sorted(against_2.attrs["baseline"]["untimed"]) == ["0", "1", "2", "3"]
    assert "the baseline, job 2, is not timed" in format_text(against_2, width=None)


def test_markdown_and_page_say_not_timed(sweep: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "r"
    assert main([str(sweep), "--no-plots", "--html", "--out", str(out), "--baseline", "3"]) == 0
    console = capsys.readouterr().out
    assert "fastest: job 0" in console and "not timed" in _row(console, "2")
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 2 |"))
    assert row.count("not timed") == 2  # on the front, and its change against job 3
    page = (out / "report.html").read_text()
    assert "not timed" in page and "fastest: job 0" in page
    csv = (out / "report.csv").read_text()
    assert "5000.0" in csv  # the raw number stays in the data


def test_the_throughput_plot_leaves_the_untimed_job_off_the_front(sweep: Path) -> None:
    from memlab.cli.report.plots import memory_vs_throughput_figure

    df = build_table(load_summaries([sweep]))
    ax = memory_vs_throughput_figure(df).axes[0]
    (stairs,) = [ln for ln in ax.lines if ln.get_drawstyle() == "steps-post"]
    assert list(stairs.get_xdata())[:1] == [60.0]  # job 1 alone on the front
    assert all(x != 50.0 for c in ax.containers for x in c.lines[0].get_xdata())
    said = " ".join(t.get_text() for t in ax.texts)
    assert "#2 (not timed)" in said and "fewer than 3 timed steps" in said


def test_fit_and_report_share_the_rule() -> None:
    """One rule, in :mod:`memlab.measure.speed`: fit's verdicts are the report's."""
    from memlab.cli.fit import speed as fit_speed
    from memlab.measure import speed

    assert fit_speed.MIN_TIMED is speed.MIN_TIMED == 3
    assert not fit_speed.timed({"tokens_per_s": 5000.0, "timed_steps": 2})
    assert fit_speed.timed({"tokens_per_s": 990.0, "timed_steps": 3})
    a = {"tokens_per_s": 1000.0, "tokens_per_s_std": 5.0}
    b = {"tokens_per_s": 990.0, "tokens_per_s_std": 15.0}
    assert fit_speed._tied(a, b) and speed.tied(1000.0, 5.0, 990.0, 15.0)
    assert speed.faster(1000.0, 5.0, 700.0, 5.0) and not speed.faster(1000.0, 5.0, 990.0, 15.0)
