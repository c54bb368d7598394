"""Unit tests of ``memlab report`` on hand-made summaries (no training, no torch)."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memlab.cli import report
from memlab.cli.report import build_table, load_summaries, main, pareto_front

MIB = 2**20
OOM_ERROR = (
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity; "
    "75.00 GiB already allocated)\nTraceback (most recent call last):\n  File train.py, line 3"
)
BASE_CHOICES = {
    "method": "sft",
    "packing": "none",
    "attention": "sdpa",
    "precision": "fp32",
    "offload": "none",
    "peft": "none",
    "distributed": "single",
    "model": "tiny",
    "data": "embedded",
    "logger": "none",
}


def make_summary(
    *,
    num: int | None,
    peft: str,
    gc: str,
    status: str = "ok",
    error: str | None = None,
    peak_mib: float | None = None,
    tps: float | None = None,
    loss: float | None = 2.5,
    timed: int | None = 10,
) -> dict[str, Any]:
    """A summary.json payload; memory is split 10/10/20/50/10 % across the categories;
    ``timed``: its timed steps (None: a summary without the count, not timed)."""
    memory = throughput = data = train = None
    if peak_mib is not None:
        peak = int(peak_mib * MIB)
        shares = {"parameters": 0.1, "gradients": 0.1, "optimizer": 0.2, "activations": 0.5}
        cats = {k: int(peak * v) for k, v in shares.items()}
        cats["other"] = peak - sum(cats.values())
        memory = {
            "device": "cpu",
            "source": "tracker",
            "peak_bytes": peak,
            "by_category": cats,
            "by_phase": {"forward": peak // 2, "backward": peak, "optimizer": peak // 3},
            "cuda": None,
        }
    if tps is not None:
        throughput = {"tokens_per_s": tps, "samples_per_s": tps / 64, "step_time_s": 0.1}
        throughput["tokens"] = 6400
        if timed is not None:
            throughput["timed_steps"] = timed
        data = {"padding_fraction": 0.25, "tokens_dropped": 0, "rows": 100, "examples": 100}
        data["fill_ratio"] = None
        train = {"final_loss": loss, "steps": 10, "loss_curve": [3.0, loss]}
    return {
        "status": status,
        "error": error,
        "choices": {**BASE_CHOICES, "peft": peft},
        "overrides": [f"peft={peft}", f"train.gradient_checkpointing={gc}", "train.seed=0"],
        "run_dir": f"/somewhere/{num}",
        "job": {"name": "train", "num": num, "sweep_dir": "/somewhere"},
        "memory": memory,
        "throughput": throughput,
        "data": data,
        "train": train,
        "versions": {"python": "3.11"},
        "device": {"type": "cpu", "name": "cpu", "count": 1},
        "wall_time_s": 1.0,
    }


def write_job(sweep: Path, num: int, summary: dict[str, Any] | None, overrides: list[str]) -> Path:
    """A Hydra job dir ``<sweep>/<num>`` with ``.hydra/overrides.yaml`` and maybe a summary."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary, indent=1))
    return job


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    """A fake multirun: 3 ok jobs, one without summary (missing), one OOM.

    ======  =====  ======  ========  ======  ===========================
    job     peft   gc      peak MiB  tok/s   note
    ======  =====  ======  ========  ======  ===========================
    0       none   false   100       1000    Pareto (fastest)
    1       lora   false   60        800     Pareto
    2       lora   true    -         -       no summary.json -> missing
    3       none   true    -         -       oom
    4       lora   true    110       700     dominated by job 0
    ======  =====  ======  ========  ======  ===========================
    """
    root = tmp_path / "multirun" / "12-00-00"
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    specs = [
        dict(num=0, peft="none", gc="false", peak_mib=100, tps=1000.0, loss=2.0),
        dict(num=1, peft="lora", gc="false", peak_mib=60, tps=800.0, loss=2.2),
        dict(num=2, peft="lora", gc="true"),
        dict(num=3, peft="none", gc="true", status="oom", error=OOM_ERROR),
        dict(num=4, peft="lora", gc="true", peak_mib=110, tps=700.0, loss=2.1),
    ]
    for spec in specs:
        summary = make_summary(**spec)
        write_job(root, spec["num"], None if spec["num"] == 2 else summary, summary["overrides"])
    return root


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


# ------------------------------------------------------------------------------ pareto_front


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        # (1,1) dominates (2,1); (2,2) dominates (3,2); (3,3) is the fastest.
        ([(1, 1), (2, 2), (2, 1), (3, 3), (3, 2)], [0, 1, 3]),
        # duplicates on the front are both kept ...
        ([(1, 5), (1, 5), (2, 4)], [0, 1]),
        # ... and duplicates that are dominated are both dropped
        ([(2, 1), (2, 1), (1, 2)], [2]),
        ([(5.0, 5.0)], [0]),
        ([], []),
        # all-equal memory: only the highest throughput (twice) survives
        ([(10, 1), (10, 3), (10, 3), (10, 2)], [1, 2]),
        # all-equal throughput: only the lowest memory survives
        ([(3, 1), (1, 1), (2, 1)], [1]),
        # a staircase: every point trades memory for speed
        ([(4, 40), (1, 10), (3, 30), (2, 20)], [0, 1, 2, 3]),
    ],
)
def test_pareto_front(points: list[tuple[float, float]], expected: list[int]) -> None:
    assert pareto_front(points) == expected


def test_pareto_front_rejects_nan() -> None:
    with pytest.raises(ValueError, match="not finite"):
        pareto_front([(1.0, 2.0), (math.nan, 1.0)])


# ------------------------------------------------------------------------------ loading


def test_load_summaries_statuses_and_reasons(sweep: Path) -> None:
    summaries = load_summaries([sweep])
    assert [s["status"] for s in summaries] == ["ok", "ok", "missing", "oom", "ok"]
    missing = summaries[2]
    assert missing["overrides"] == [
        "peft=lora",
        "train.gradient_checkpointing=true",
        "train.seed=0",
    ]
    assert missing["job"]["num"] == 2
    assert "no summary.json" in missing["error"]
    assert summaries[3]["error"] == OOM_ERROR


def test_load_summaries_accepts_run_dirs_files_and_dedups(sweep: Path) -> None:
    summaries = load_summaries([sweep / "1", sweep / "0" / "summary.json", sweep])
    assert [s["job"]["num"] for s in summaries] == [1, 0, 2, 3, 4]


def test_load_summaries_natural_order(tmp_path: Path) -> None:
    for num in (10, 2, 1):
        write_job(tmp_path, num, make_summary(num=num, peft="none", gc="false"), [])
    assert [s["job"]["num"] for s in load_summaries([tmp_path])] == [1, 2, 10]


def test_corrupt_summary_is_reported_not_raised(tmp_path: Path) -> None:
    job = write_job(tmp_path, 0, None, ["peft=lora"])
    (job / "summary.json").write_text('{"status": "ok", "memory": ')
    bad_list = write_job(tmp_path, 1, None, [])
    (bad_list / "summary.json").write_text("[1, 2]")
    summaries = load_summaries([tmp_path])
    assert [s["status"] for s in summaries] == ["corrupt", "corrupt"]
    assert str(job / "summary.json") in summaries[0]["error"]
    assert summaries[0]["overrides"] == ["peft=lora"]
    df = build_table(summaries)
    assert list(df["status"]) == ["corrupt", "corrupt"]


def test_missing_job_reads_choices_from_hydra_yaml(tmp_path: Path) -> None:
    write_job(tmp_path, 0, make_summary(num=0, peft="none", gc="false", peak_mib=1, tps=1.0), [])
    job = write_job(tmp_path, 1, None, ["peft=none"])
    choices = "\n".join(f"      {k}: {v}" for k, v in {**BASE_CHOICES, "precision": "bf16"}.items())
    hydra_yaml = "hydra:\n  runtime:\n    choices:\n" + choices + "\n      hydra/launcher: basic\n"
    (job / ".hydra" / "hydra.yaml").write_text(hydra_yaml)
    missing = load_summaries([tmp_path])[1]
    assert missing["status"] == "missing"
    assert missing["choices"]["precision"] == "bf16"
    assert "hydra/launcher" not in missing["choices"]
    df = build_table(load_summaries([tmp_path]))
    assert "precision" in df.attrs["params"]


def test_load_summaries_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_summaries([tmp_path / "nope"])


# ------------------------------------------------------------------------------ table


def test_build_table_rows_and_columns(sweep: Path) -> None:
    df = build_table(load_summaries([sweep]))
    assert len(df) == 5
    assert df.attrs["params"] == ["peft", "train.gradient_checkpointing"]
    assert list(df.columns) == [
        "job",
        "peft",
        "train.gradient_checkpointing",
        "status",
        "error",
        "peak_MiB",
        "params_MiB",
        "grads_MiB",
        "optim_MiB",
        "activ_MiB",
        "other_MiB",
        "tokens_per_s",
        "tps_spread",
        "timed_steps",
        "padding_frac",
        "final_loss",
        "generate_MiB",
        "forward_MiB",
        "backward_MiB",
        "optimizer_MiB",
        "eval_MiB",
        "pareto",
        "run_dir",
    ]
    fixed = df.attrs["fixed"]
    assert fixed["model"] == "tiny" and fixed["precision"] == "fp32"
    assert fixed["train.seed"] == "0"
    for constant in ("model", "precision", "train.seed", "method"):
        assert constant not in df.columns
    assert report.fixed_line(df).startswith("fixed: method=sft, packing=none")

    by_job = df.set_index("job")
    assert by_job.loc["1", "peak_MiB"] == pytest.approx(60.0)
    assert by_job.loc["1", "activ_MiB"] == pytest.approx(30.0, abs=1e-3)
    assert by_job.loc["1", "params_MiB"] + by_job.loc["1", "other_MiB"] == pytest.approx(12.0, 1e-3)
    assert by_job.loc["0", "tokens_per_s"] == 1000.0
    assert by_job.loc["0", "padding_frac"] == 0.25
    assert by_job.loc["0", "final_loss"] == 2.0
    assert by_job.loc["2", "status"] == "missing"
    assert by_job.loc["2", "peft"] == "lora"
    assert math.isnan(by_job.loc["2", "peak_MiB"])
    # The reason is the whole first line (the traceback stays in the Markdown).
    err = by_job.loc["3", "error"]
    assert err == OOM_ERROR.splitlines()[0]
    assert by_job.loc["1", "forward_MiB"] == pytest.approx(30.0, abs=1e-3)
    assert math.isnan(by_job.loc["1", "generate_MiB"])
    assert by_job.loc["0", "error"] == ""
    assert by_job["pareto"].to_dict() == {"0": True, "1": True, "2": False, "3": False, "4": False}


def test_a_generation_engines_memory_gets_its_own_column(tmp_path: Path) -> None:
    """memory.generation_engine (a colocated vLLM engine's weights, buffers and KV cache, not
    in the tracker's peak) becomes engine_MiB after other_MiB, only where a job has one."""
    root = tmp_path / "multirun"
    root.mkdir()
    plain = make_summary(num=0, peft="none", gc="false", peak_mib=100, tps=1000.0)
    engine = make_summary(num=1, peft="lora", gc="false", peak_mib=60, tps=800.0)
    engine["memory"]["generation_engine"] = {"weights_bytes": 7 * 2**20, "buffers_bytes": 2**20,
                                             "kv_cache_bytes": 2**30, "measured_load_bytes": None}
    for num, summary in enumerate((plain, engine)):
        write_job(root, num, summary, summary["overrides"])
    df = build_table(load_summaries([root])).set_index("job")
    cols = list(df.columns)
    assert cols[cols.index("other_MiB") + 1] == "engine_MiB"
    assert df.loc["1", "engine_MiB"] == pytest.approx(1032.0)
    assert math.isnan(df.loc["0", "engine_MiB"])
    assert df.loc["1", "peak_MiB"] == pytest.approx(60.0, 1e-3)  # the peak stays the tracker's
    lines = report.format_markdown(build_table(load_summaries([root]))).splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| job |"))
    cells = [c.strip() for c in lines[head].strip("|").split("|")]
    align = lines[head + 1].strip("|").split("|")
    assert align[cells.index("engine_MiB")] == "---:"  # a number column


def test_build_table_default_sort_failed_last(sweep: Path) -> None:
    df = build_table(load_summaries([sweep]))
    assert list(df["job"]) == ["1", "0", "4", "2", "3"]


@pytest.mark.parametrize(
    ("sort", "desc", "expected"),
    [
        ("tokens_per_s", True, ["0", "1", "4", "2", "3"]),
        ("tokens_per_s", False, ["4", "1", "0", "2", "3"]),
        ("peak_MiB", True, ["4", "0", "1", "2", "3"]),
        ("final_loss", False, ["0", "4", "1", "2", "3"]),
        ("peft", False, ["1", "4", "0", "2", "3"]),
        ("job", True, ["4", "1", "0", "3", "2"]),
        ("tps", True, ["0", "1", "4", "2", "3"]),  # alias
        ("PEAK", False, ["1", "0", "4", "2", "3"]),  # alias, any case
    ],
)
def test_sort(sweep: Path, sort: str, desc: bool, expected: list[str]) -> None:
    df = build_table(load_summaries([sweep]), sort=sort, desc=desc)
    assert list(df["job"]) == expected
    assert df.attrs["params"] == ["peft", "train.gradient_checkpointing"]


def test_sort_numeric_text_column(tmp_path: Path) -> None:
    for num, mbs in enumerate(["16", "2", "8"]):
        summary = make_summary(num=num, peft="none", gc="false", peak_mib=10 + num, tps=1.0)
        summary["overrides"] = [f"train.micro_batch_size={mbs}"]
        write_job(tmp_path, num, summary, summary["overrides"])
    df = build_table(load_summaries([tmp_path]), sort="train.micro_batch_size")
    assert list(df["train.micro_batch_size"]) == ["2", "8", "16"]


def test_sort_unknown_column(sweep: Path) -> None:
    with pytest.raises(KeyError, match="unknown column 'nope'"):
        build_table(load_summaries([sweep]), sort="nope")


def test_override_parsing_and_duplicate_job_numbers(tmp_path: Path) -> None:
    for sweep_name, peak in (("a", 10), ("b", 20)):
        summary = make_summary(num=0, peft="none", gc="false", peak_mib=peak, tps=float(peak))
        summary["overrides"] = ["+extra=1", "++train.lr=1e-4", "hydra.job.chdir=true", "~logger"]
        write_job(tmp_path / sweep_name, 0, summary, summary["overrides"])
    df = build_table(load_summaries([tmp_path / "a", tmp_path / "b"]))
    assert list(df["job"]) == ["a/0", "b/0"]
    assert df.attrs["fixed"]["extra"] == "1"
    assert df.attrs["fixed"]["train.lr"] == "1e-4"
    assert df.attrs["fixed"]["logger"] == "~"
    assert not any(k.startswith("hydra") for k in df.attrs["fixed"])
    assert list(df["pareto"]) == [True, True]


INVALID = ("invalid configuration (2 problem(s)):\n"
           "  - attention=flash_attention_2 runs only on cuda, and this run is on cpu; use "
           "attention=sdpa or attention=eager here\n"
           "  - precision=fp16_mixed needs a CUDA device; on CPU use precision=fp32")


def test_short_reason() -> None:
    assert report.short_reason(None) == ""
    assert report.short_reason("\n  boom  \nmore") == "boom"
    assert report.short_reason("x" * 200) == "x" * 200  # never cut
    assert report.short_reason(INVALID) == (
        "attention=flash_attention_2 runs only on cuda, and this run is on cpu; use "
        "attention=sdpa or attention=eager here; precision=fp16_mixed needs a CUDA device; on "
        "CPU use precision=fp32")


def test_invalid_reason_kept_in_table_and_csv(tmp_path: Path) -> None:
    import pandas as pd

    summary = make_summary(num=0, peft="none", gc="false", status="invalid", error=INVALID)
    write_job(tmp_path, 0, summary, summary["overrides"])
    ok = make_summary(num=1, peft="lora", gc="false", peak_mib=10, tps=5.0)
    write_job(tmp_path, 1, ok, ok["overrides"])
    assert main([str(tmp_path), "--no-plots"]) == 0
    csv = pd.read_csv(tmp_path / "report.csv").set_index("job")
    assert csv.loc[0, "error"] == report.short_reason(INVALID)
    assert "use precision=fp32" in csv.loc[0, "error"]


# ------------------------------------------------------------------------------ outputs / CLI


@pytest.mark.slow
def test_main_writes_reports_and_plots(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image as mpimg
    import pandas as pd

    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fixed: method=sft")
    header = next(line for line in out.splitlines() if line.startswith("job ")).split()
    assert header[:2] == ["job", "peft"] and "status" in header  # (120 columns: test_report_text)
    assert "checkpointing" in out and "run_dir" not in header
    assert "CUDA out of memory" in out

    csv = pd.read_csv(sweep / "report.csv")
    assert len(csv) == 5
    assert list(csv["status"]) == ["ok", "ok", "ok", "missing", "oom"]

    md = (sweep / "report.md").read_text()
    table_rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table_rows) == 1 + 5  # header + one row per job
    assert "fixed: method=sft" in md
    assert "## Jobs that did not end ok" in md
    assert "File train.py, line 3" in md  # the full reason, not only its first line
    assert "### job 2: `missing`" in md

    for name in ("memory_by_category.png", "memory_vs_throughput.png"):
        path = sweep / name
        assert path.stat().st_size > 1024
        image = mpimg.imread(path)
        width, height = png_size(path)
        assert image.shape[:2] == (height, width)
        assert width > 400 and height > 200


def test_main_out_dir_and_no_plots(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "reports" / "x"
    assert main([str(sweep), "--out", str(out), "--no-plots", "--sort", "tps", "--desc"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.csv", "report.md"]
    assert not (sweep / "report.csv").exists()


def test_main_single_summary_file(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "single"
    assert main([str(sweep / "1" / "summary.json"), "--out", str(out)]) == 0
    assert (out / "memory_by_category.png").stat().st_size > 1024
    assert "fixed: method=sft" in (out / "report.md").read_text()


def test_main_no_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    assert "no summary.json found" in capsys.readouterr().err
    write_job(tmp_path, 0, None, ["peft=lora"])
    assert main([str(tmp_path)]) == 2
    assert "without a summary" in capsys.readouterr().err
    assert not (tmp_path / "report.csv").exists()


def test_main_bad_inputs(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main([str(sweep), "--sort", "bogus", "--no-plots"]) == 2
    assert "unknown column 'bogus'" in capsys.readouterr().err


def test_plots_skipped_when_nothing_ok(tmp_path: Path) -> None:
    summary = make_summary(num=0, peft="none", gc="false", status="failed", error="boom")
    write_job(tmp_path, 0, summary, [])
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "report.md").exists()
    assert not (tmp_path / "memory_by_category.png").exists()
    assert not (tmp_path / "memory_vs_throughput.png").exists()


def test_import_is_light() -> None:
    code = (
        "import sys, memlab.cli.report; "
        "print([m for m in ('torch', 'transformers', 'pandas', 'matplotlib') if m in sys.modules]"
        " + [memlab.cli.report.__file__])"
    )
    src = str(Path(report.__file__).resolve().parents[3])
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": src, "PATH": ""},
    )
    assert res.stdout.strip() == repr([str(Path(report.__file__).resolve())])


# ------------------------------------------------------------------------------ spread, plots, page


def _timed(summary: dict[str, Any], steps: int, std: float | None) -> dict[str, Any]:
    summary["throughput"]["timed_steps"] = steps
    if std is not None:
        summary["throughput"]["tokens_per_s_std"] = std
    return summary


@pytest.mark.parametrize(
    ("points", "spreads", "expected"),
    [
        # 1% faster for 1% more memory: within a 2% spread it is not faster -> dominated
        ([(100, 1000), (101, 1010)], [20, 20], [0]),
        # ... but measurably faster with a 0.1% spread: both on the front
        ([(100, 1000), (101, 1010)], [1, 1], [0, 1]),
        # less memory and slower within the spread: the cheaper one dominates
        ([(100, 1000), (90, 995)], [10, 10], [1]),
        # equal memory, speeds within the spread: neither dominates
        ([(100, 1000), (100, 1005)], [10, 10], [0, 1]),
        # the larger of the two spreads decides
        ([(100, 1000), (101, 1010)], [1, 20], [0]),
    ],
)
def test_pareto_front_with_spread(points, spreads, expected) -> None:
    assert pareto_front(points, spreads) == expected
    assert pareto_front(points) == pareto_front(points, [0] * len(points))


def test_single_timed_steps_are_flagged_and_not_on_the_front_by_1pct(tmp_path: Path) -> None:
    """The issue's case: two jobs 1% apart in tokens/s, each timed on one step: not timed, so
    neither is on the front (issue 45 item 4); timed, with no spread in their summaries, the
    front assumes 5% and the 1% is no difference; with measured spreads of 0.2% it is one."""
    a = _timed(make_summary(num=0, peft="none", gc="true", peak_mib=100, tps=1000.0), 1, None)
    b = _timed(make_summary(num=1, peft="none", gc="false", peak_mib=150, tps=1010.0), 1, None)
    for s in (a, b):
        write_job(tmp_path, s["job"]["num"], s, s["overrides"])
    df = build_table(load_summaries([tmp_path]))
    assert df.set_index("job")["pareto"].to_dict() == {"0": False, "1": False}
    assert df.attrs["untimed"] == ["0", "1"] and df.attrs["fastest"] is None
    text = report.format_text(df)
    assert "1!" in text and "not timed: job(s) 0, 1 (fewer than 3 timed steps" in text
    for s in (a, b):  # timed, but no spread recorded: 5% assumed
        _timed(s, 8, None)
        (tmp_path / str(s["job"]["num"]) / "summary.json").write_text(json.dumps(s))
    df = build_table(load_summaries([tmp_path]))
    assert df.set_index("job")["pareto"].to_dict() == {"0": True, "1": False}
    assert df.attrs["unmeasured"] == ["0", "1"] and df.attrs["untimed"] == []
    assert "no measured spread for job(s) 0, 1" in report.format_text(df)
    # measured spreads of 0.2% make the 1% a real difference: both on the front
    for s in (a, b):
        _timed(s, 8, 2.0)
        (tmp_path / str(s["job"]["num"]) / "summary.json").write_text(json.dumps(s))
    df = build_table(load_summaries([tmp_path]))
    assert list(df["pareto"]) == [True, True] and df.attrs["unmeasured"] == []
    assert list(df["tps_spread"]) == [2.0, 2.0] and list(df["timed_steps"]) == [8.0, 8.0]


def test_throughput_plot_staircase_labels_budget(sweep: Path) -> None:
    from memlab.cli.report.plots import memory_vs_throughput_figure

    df = build_table(load_summaries([sweep]))
    ax = memory_vs_throughput_figure(df, budget_mib=80.0).axes[0]
    stairs = [ln for ln in ax.lines if ln.get_drawstyle() == "steps-post"]
    assert len(stairs) == 1
    xs, ys = (list(v) for v in stairs[0].get_data())
    assert xs[:2] == [60.0, 100.0] and ys[:3] == [800.0, 1000.0, 1000.0]  # job 1, job 0, edge
    budget = [ln for ln in ax.lines if list(ln.get_xdata()) == [80.0, 80.0]]
    assert len(budget) == 1 and budget[0].get_linestyle() == "--"
    labels = sorted(t.get_text() for t in ax.texts if "peft=" in t.get_text())
    assert labels == ["peft=lora, gradient_checkpointing=false",
                      "peft=lora, gradient_checkpointing=true",
                      "peft=none, gradient_checkpointing=false"]


def test_phase_plot_and_html_page(sweep: Path, tmp_path: Path) -> None:
    from memlab.cli.report.plots import memory_by_phase_figure

    df = build_table(load_summaries([sweep]))
    ax = memory_by_phase_figure(df, budget_mib=200.0).axes[0]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [
        "backward", "budget 200 MiB", "forward", "optimizer"]
    widths = sorted(round(p.get_width(), 3) for p in ax.patches)
    assert widths[-1] == pytest.approx(110.0)  # job 4's backward = its peak
    out = tmp_path / "r"
    assert main([str(sweep), "--out", str(out), "--html", "--budget", "0.1GiB"]) == 0
    page = (out / "report.html").read_text()
    assert page.count("<tr class=") - page.count(' reason"><td>') == 5  # a reason: its own row
    assert page.count("data:image/png;base64,") == 4
    assert "CUDA out of memory" in page and "File train.py, line 3" in page
    assert (out / "memory_by_phase.png").stat().st_size > 1024
    assert "![memory_by_phase.png](memory_by_phase.png)" in (out / "report.md").read_text()
    assert main([str(sweep), "--out", str(out), "--budget", "lots"]) == 2


def test_loss_curves_overlaid(sweep: Path, tmp_path: Path) -> None:
    """One line per ok job with a loss curve (optimizer step from 1 on x), labelled by what
    varies; the jobs without a curve are named under the plot; a file beside the others."""
    from memlab.cli.report.plots import loss_curves_figure

    df = build_table(load_summaries([sweep]))
    assert df.attrs["loss_curves"] == {"0": [3.0, 2.0], "1": [3.0, 2.2], "4": [3.0, 2.1]}
    ax = loss_curves_figure(df).axes[0]
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}
    assert lines == {"#0 peft=none, gradient_checkpointing=false": ([1, 2], [3.0, 2.0]),
                     "#1 peft=lora, gradient_checkpointing=false": ([1, 2], [3.0, 2.2]),
                     "#4 peft=lora, gradient_checkpointing=true": ([1, 2], [3.0, 2.1])}
    assert any("#2 (missing)" in t.get_text() and "#3 (oom)" in t.get_text() for t in ax.texts)
    out = tmp_path / "r"
    assert main([str(sweep), "--out", str(out)]) == 0
    assert (out / "loss_curves.png").stat().st_size > 1024
    assert "![loss_curves.png](loss_curves.png)" in (out / "report.md").read_text()


@pytest.mark.parametrize(("hidden", "flags", "named"), [
    ("pandas", [], "pandas"), ("matplotlib", [], "matplotlib"), ("pandas", ["--no-plots"],
                                                                  "pandas"),
    ("jinja2", ["--html", "--no-plots"], "jinja2")])
def test_missing_extra_is_one_line(sweep: Path, hidden: str, flags: list[str], named: str):
    code = (f"import sys; sys.modules[{hidden!r}] = None; "
            "from memlab.cli.report import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, str(sweep), *flags],
                         capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "memlab[report]" in lines[0], res.stderr
    assert not (sweep / "report.csv").exists()


# ------------------------------------------------------------------------------ --baseline


def test_baseline_changes_against_a_job_or_an_override(sweep: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Against job 0 (100 MiB, 1000 tokens/s): job 1 saves 40 MiB (20 of them activations, the
    10/10/20/50/10 % split) and is 20% slower; the oom job has no change; job 0 reads 0."""
    df = report.add_baseline(build_table(load_summaries([sweep])), "0")
    row = {str(j): i for i, j in enumerate(df["job"])}
    one, zero, oom = df.loc[row["1"]], df.loc[row["0"]], df.loc[row["3"]]
    assert one["d_peak_MiB"] == pytest.approx(-40.0) and one["d_peak_pct"] == pytest.approx(-40)
    assert one["d_activ_MiB"] == pytest.approx(-20.0, abs=1e-5)
    assert one["d_optim_MiB"] == pytest.approx(-8.0, abs=1e-5)
    assert one["d_tokens_per_s_pct"] == pytest.approx(-20.0)
    assert zero["d_peak_MiB"] == 0 and zero["d_tokens_per_s_pct"] == 0
    assert math.isnan(oom["d_peak_MiB"]) and math.isnan(oom["d_tokens_per_s_pct"])
    assert list(df.columns).index("d_peak_MiB") == list(df.columns).index("pareto") + 1
    # by override: the one job with gradient checkpointing on that finished
    by_override = report.add_baseline(
        build_table([s for s in load_summaries([sweep]) if s["status"] != "missing"
                     and s["status"] != "oom"]), "gradient_checkpointing=true")
    assert by_override.attrs["baseline"]["job"] == "4"
    with pytest.raises(report.BaselineError, match=r"2 jobs have it \(jobs 0, 3\)"):
        report.add_baseline(build_table(load_summaries([sweep])), "peft=none")
    with pytest.raises(report.BaselineError, match="no job is 'peft=qlora'; give a job"):
        report.add_baseline(build_table(load_summaries([sweep])), "peft=qlora")
    assert main([str(sweep), "--out", str(tmp_path / "r"), "--no-plots",
                 "--baseline", "0"]) == 0
    text = capsys.readouterr().out  # 120 columns: the changes in percent
    assert "-40.0%" in text and "-20.0%" in text and "change against the baseline, job 0" in text
    assert "d_*_MiB" in next(x for x in text.splitlines() if x.startswith("left out"))
    assert main([str(sweep), "--out", str(tmp_path / "r"), "--no-plots", "--baseline", "0",
                 "--wide"]) == 0
    wide = capsys.readouterr().out.splitlines()
    header = next(x for x in wide if x.startswith("job ")).split()
    assert {"d_peak_MiB", "d_activ_MiB", "d_tokens_per_s_pct"} <= set(header)
    row = next(x for x in wide if x.startswith("1 ")).split()
    assert row[header.index("d_peak_MiB")] == "-40.0"
    assert row[header.index("d_activ_MiB")] == "-20.0"
    csv = (tmp_path / "r" / "report.csv").read_text().splitlines()[0]
    assert "d_activ_MiB" in csv and "d_tokens_per_s_pct" in csv
    assert main([str(sweep), "--no-plots", "--baseline", "9"]) == 2
    assert "no job is '9'" in capsys.readouterr().err


def test_eval_loss_column_and_zero_floored_error_bars(tmp_path: Path) -> None:
    """A job evaluated on held-out data shows its final eval loss next to memory and speed;
    a tokens/s spread larger than the tokens/s draws no error bar below zero."""
    from memlab.cli.report.plots import memory_vs_throughput_figure

    for num, (tps, spread) in enumerate([(100.0, 400.0), (900.0, 5.0)]):
        s = make_summary(num=num, peft=("none", "lora")[num], gc="false", peak_mib=10 + num,
                         tps=tps)
        s["throughput"].update(tokens_per_s_std=spread, timed_steps=4)
        if num == 1:
            s["eval"] = {"final": {"step": 10, "loss": 2.75}, "history": []}
        write_job(tmp_path, num, s, s["overrides"])
    df = build_table(load_summaries([tmp_path]))
    assert list(df.columns).index("eval_loss") == list(df.columns).index("final_loss") + 1
    assert math.isnan(df.loc[0, "eval_loss"]) and df.loc[1, "eval_loss"] == 2.75
    assert "eval_loss" in report.format_text(df) and "2.7500" in report.format_text(df)
    ax = memory_vs_throughput_figure(df).axes[0]
    bars = [seg for c in ax.collections for seg in c.get_segments()]
    assert bars and min(y for seg in bars for _, y in seg) == 0.0
    assert ax.get_ylim()[0] >= 0.0


HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>`x`\x1b]0;owned\x07\x1b[2J"


def test_hostile_strings_are_shown_not_obeyed(tmp_path: Path, capsys) -> None:
    """A data file's name, an override, an error quoting data and a run dir with a backtick
    reach report.md as text (no HTML, no code span or fence they can close), report.csv
    without a cell a spreadsheet evaluates, and the console without a control character."""
    root = tmp_path / "multi`run`"  # a run dir with backticks
    root.mkdir()
    ok = make_summary(num=0, peft="none", gc="false", peak_mib=100, tps=1000.0)
    ok["overrides"] += [f"data.path={HOSTILE}.jsonl", "logger.tags==HYPERLINK(\"x\")"]
    bad = make_summary(num=1, peft="lora", gc="false", status="failed",
                       error=f"bad row in {HOSTILE}.jsonl\n``` </pre> ```\nline 2")
    for s in (ok, bad):
        write_job(root, s["job"]["num"], s, s["overrides"])
    assert main([str(root), "--no-plots", "--html"]) == 0
    console = capsys.readouterr()
    for text in (console.out, console.err):
        assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b]0;owned\\x07" in console.out  # shown, escaped
    md = (root / "report.md").read_text()
    assert "\x1b" not in md
    assert f"run dir: `` {root / '1'} ``" in md  # a code span no backtick inside closes
    fence = "````"  # the error holds a run of three backticks: its block takes four
    assert f"{fence}text\n" in md and md.count(f"\n{fence}\n") == 1
    before, block = md.split(f"{fence}text\n")
    rendered = before + block.split(f"\n{fence}\n")[1]  # (a code block shows its text as is)
    assert "<script" not in rendered and "<img" not in rendered
    assert "&lt;script&gt;" in rendered  # the file name in the table, as text
    import csv

    cells = [c for row in csv.reader((root / "report.csv").open()) for c in row]
    assert not any(c.startswith(("=", "+", "@")) for c in cells)
    assert "'=HYPERLINK(\"x\")" in cells  # the tag, kept as text
    # report.html (a jinja2 template, autoescape on): every element is the template's own; the
    # data its script reads holds the strings whole, as JSON no `</script>` or `<!--` can end
    from html.parser import HTMLParser

    page = (root / "report.html").read_text()
    tags: list[str] = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            tags.append(tag)

    Tags().feed(page)
    assert tags.count("script") == 2 and "img" not in tags  # the data and the page's script
    assert "<script>alert" not in page and "<img src=x" not in page and "\x1b" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # in the table, the reason, as text
    block = page.split('<script type="application/json" id="report-data">')[1]
    block = block.split("</script>")[0]
    assert "<" not in block and ">" not in block and "&" not in block
    data = json.loads(block)
    assert any(HOSTILE.split("\x1b")[0] in str(text) for row in data["texts"] for text in row)


def test_baseline_by_several_settings_names_one_job_and_marks_its_row(
        sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 45 item 6: where several settings vary, ``--baseline`` takes them together
    (``key=value`` pairs, a key or its last dotted part); one that names several jobs is refused
    with the exact ``--baseline`` naming each; the baseline's row is marked."""
    df = build_table(load_summaries([sweep]))
    assert report.add_baseline(df, ["peft=none", "train.gradient_checkpointing=true"]).attrs[
        "baseline"]["job"] == "3"
    assert report.add_baseline(df, ["gradient_checkpointing=false", "peft=lora"]).attrs[
        "baseline"]["job"] == "1"
    assert report.add_baseline(df, ["peft=none", "train.seed=0", "gradient_checkpointing=false"]
                               ).attrs["baseline"]["job"] == "0"  # a fixed setting at its value
    with pytest.raises(report.BaselineError) as e:
        report.add_baseline(df, ["peft=none"])
    assert ("name one: --baseline peft=none train.gradient_checkpointing=false (job 0), or "
            "--baseline peft=none train.gradient_checkpointing=true (job 3)") in str(e.value)
    with pytest.raises(report.BaselineError, match=r"'0' is not key=value \(a job id stands "
                                                   r"alone\); give a job id \(--baseline 1;"):
        report.add_baseline(df, ["0", "peft=none"])
    with pytest.raises(report.BaselineError, match="every job has train.seed=0"):
        report.add_baseline(df, ["peft=none", "train.seed=1"])
    # the command line: the pairs after --baseline, a path after them is a path
    out = tmp_path / "r"
    assert main(["--out", str(out), "--no-plots", "--baseline", "peft=none",
                 "gradient_checkpointing=false", str(sweep)]) == 0
    text = capsys.readouterr().out
    assert "0 (baseline)" in text and text.count("(baseline)") == 1
    assert ("job 0 (peft=none gradient_checkpointing=false)" in text)
    assert main([str(sweep), "--no-plots", "--out", str(out), "--baseline", "peft=none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--baseline peft=none train.gradient_checkpointing=" \
        "false (job 0)" in err


def test_the_cookbook_baseline_recipe_works_as_written(sweep: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]):
    """The cookbook's W&B recipe sweeps peft x gradient checkpointing; its report line, as the
    page writes it, names the full fine-tuning job without checkpointing."""
    import shlex

    from memlab_testing import REPO

    cookbook = (REPO / "docs" / "cookbook.md").read_text()
    line = next(x for x in cookbook.splitlines()
                if x.startswith("memlab report") and "--baseline" in x)
    argv = shlex.split(line.replace("multirun/<date>/<time>", str(sweep)))[2:]
    assert main([*argv, "--no-plots", "--out", str(tmp_path / "r")]) == 0, line
    out = capsys.readouterr().out
    assert "0 (baseline)" in out and "change against the baseline, job 0" in out
    page = (tmp_path / "r" / "report.html").read_text()
    assert page.count('<tr class="baseline">') == 1
