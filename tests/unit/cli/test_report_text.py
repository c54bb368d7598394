"""``memlab report``'s console table fits 120 columns (issue 46 item 7): it narrows by one rule
(a reason under its row, the detail columns left out group by group, short setting names,
column names over two lines, long values cut, then blocks of columns), says on a line under the
table what it left out and that ``--wide`` shows it; ``--wide`` prints every column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memlab.cli.report import add_baseline, build_table, load_summaries, main
from memlab.cli.report.text import WIDTH, format_text

MIB = 2**20
OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.64 GiB total capacity; "
       "21.90 GiB already allocated; a reason long enough to wrap over two console lines)")


def _sweep(root: Path, settings: int = 3, jobs: int = 8, long_value: bool = False) -> Path:
    """``jobs`` jobs varying ``settings`` settings at real sizes, job 6 out of memory."""
    sweep = root / "multirun" / "sweep"
    for num in range(jobs):
        overrides = [f"peft={('none', 'lora')[num % 2]}",
                     f"train.gradient_checkpointing={('false', 'true')[num // 4]}",
                     f"method.max_length={(2048, 4096)[(num // 2) % 2]}",
                     *(f"method.knob_number_{k}={1000 * k + num % 2}" for k in range(3, settings))]
        if long_value:
            overrides.append(f"data.path=/data/sets/chat_conversations_{num % 3}.jsonl")
        oom = num == 6
        s: dict = {"status": "oom" if oom else "ok", "overrides": overrides,
                   "choices": {"method": "sft"}, "job": {"num": num}, "memory": None,
                   "throughput": None, "train": None, "error": OOM if oom else None}
        if not oom:
            peak = (15000 + 1234 * num) * MIB
            cats = {"parameters": peak // 3, "gradients": peak // 6, "optimizer": peak // 4,
                    "activations": peak // 5}
            cats["other"] = peak - sum(cats.values())
            s["memory"] = {"peak_bytes": peak, "by_category": cats}
            s["throughput"] = {"tokens_per_s": 4321.5 - 123 * num,
                               "tokens_per_s_std": 12.5, "timed_steps": 30}
            s["data"] = {"padding_fraction": 0.125}
            s["train"] = {"final_loss": 1.5 - num / 50}
            s["eval"] = {"final": {"step": 40, "loss": 1.6 + num / 40}}
        job = sweep / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (job / "summary.json").write_text(json.dumps(s))
    return sweep


def _header(text: str) -> list[str]:
    return next(line for line in text.splitlines() if line.startswith("job ")).split()


def _said(text: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith("left out (--wide shows them): ")]
    return line


def test_a_three_setting_sweep_with_a_baseline_fits_120_columns(tmp_path: Path) -> None:
    """The cookbook's question (~230 characters wide in full): every line fits, the headline
    columns stay, the details go in the stated order, each named on the line under the table."""
    df = build_table(load_summaries([_sweep(tmp_path)]))
    df = add_baseline(df, ["peft=none", "gradient_checkpointing=false", "max_length=2048"])
    wide = format_text(df, width=None)
    assert max(len(x) for x in wide.splitlines()) > 200  # what the issue saw
    text = format_text(df)
    assert max(len(x) for x in text.splitlines()) <= WIDTH, text
    header = " ".join(line for line in text.splitlines()[:6])  # names may take two lines
    for kept in ("job", "peft", "status", "peak_MiB", "pareto", "eval_loss"):
        assert kept in header
    for broken in ("tokens_", "d_tokens_"):  # names over two lines, not left out
        assert broken in header
    said = _said(text)
    assert said == ("left out (--wide shows them): run_dir, d_*_MiB, MiB by category, "
                    "padding_frac, tps_spread, timed_steps")
    for gone in ("params_MiB", "activ_MiB", "padding_frac", "tps_spread"):
        assert gone not in header and gone in _header(wide)
    assert "train.gradient_checkpointing" not in header and "checkpointing" in header
    # the reason: the line under its job's row, whole (wrapped), not a column
    lines = text.splitlines()
    row = next(i for i, x in enumerate(lines) if x.startswith("6 "))
    assert lines[row + 1].startswith("    error: CUDA out of memory.")
    assert "two console lines" in lines[row + 2]
    assert "0 (baseline)" in text and "+57.6%" in text


def test_a_table_that_fits_leaves_out_only_what_the_console_never_showed(tmp_path: Path):
    """The run dir, memory by phase and the changes by category (``--wide`` shows them; a
    column with nothing in it goes unnamed)."""
    df = build_table(load_summaries([_sweep(tmp_path, settings=1, jobs=2)]))
    df = df.drop(columns=["params_MiB", "grads_MiB", "optim_MiB", "activ_MiB", "other_MiB"])
    text = format_text(df)
    assert set(_header(format_text(df, width=None))) - set(_header(text)) == {
        "run_dir", "generate_MiB", "forward_MiB", "backward_MiB", "optimizer_MiB", "eval_MiB"}
    assert _said(text) == "left out (--wide shows them): run_dir"
    assert {"peft", "tps_spread", "padding_frac", "eval_loss"} <= set(_header(text))


def test_many_settings_and_long_values_continue_in_blocks(tmp_path: Path) -> None:
    """Twelve settings, a path among them: values cut in the middle, the table in blocks of
    columns that each start with the job, every job in each block, every line within 120."""
    df = build_table(load_summaries([_sweep(tmp_path, settings=12, jobs=6, long_value=True)]))
    text = format_text(df)
    assert max(len(x) for x in text.splitlines()) <= WIDTH, text
    heads = [x for x in text.splitlines() if x.startswith("job ")]
    assert len(heads) >= 2
    said = _said(text)
    assert "timed_steps" in said and len(said) <= WIDTH
    assert "/data/sets...ons_2.jsonl" in text  # its start and its end, 24 characters
    for job in range(6):
        assert sum(x.split()[0] == str(job) for x in text.splitlines() if x.strip()) == len(heads)


def test_wide_shows_every_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = _sweep(tmp_path)
    assert main([str(sweep), "--no-plots", "--out", str(tmp_path / "r"), "--wide"]) == 0
    out = capsys.readouterr().out
    import csv

    with (tmp_path / "r" / "report.csv").open() as f:
        columns = next(csv.reader(f))
    shown = set(_header(out))
    assert set(columns) == shown
    assert "--wide shows" not in out
    assert main([str(sweep), "--no-plots", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[1]  # the fixed line, the table, the notes, the files
    assert max(len(x) for x in table.splitlines()) <= WIDTH
    assert "left out (--wide shows them): run_dir, MiB by category; short setting names" in out
