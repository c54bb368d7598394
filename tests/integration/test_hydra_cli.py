"""memlab's command line behaves like a Hydra app, in subprocesses: memlab's own --help,
--version, tab completion for `memlab` and `python -m memlab` (bash runs the installed
completion function), and `memlab estimate` / `memlab lengths` sweeping with Hydra's grammar into
Hydra-style output dirs, writing nothing else into the current directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memlab_testing import REPO

pytestmark = pytest.mark.integration
SRC = str(REPO / "src")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
       "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=1",
        "model.num_heads=4", "model.num_kv_heads=2", "train.batch_size=2"]


def memlab(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**ENV, **{k: v for k, v in os.environ.items() if k == "MEMLAB_CPU_BF16"}}
    return subprocess.run([sys.executable, "-m", "memlab", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_is_memlabs_own():
    r = memlab("--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for sub in ("memlab report", "memlab estimate", "memlab lengths", "memlab fit",
                "memlab -m sweep=<name>"):
        assert sub in out
    assert "peft: lora, none, qlora" in out and "sweep: data_parallel, dpo_packing, foundation" in out
    assert "method.max_length=1024" in out and "train.gradient_checkpointing=false" in out
    assert "Powered by Hydra" not in out and "Show Hydra's version" not in out


def test_version_is_memlabs(tmp_path):
    from memlab import __version__

    r = memlab("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith(f"memlab {__version__} (Hydra ")


COMPLETE = r"""
source <("$@" -sc install=bash)
complete_line() {  # what bash does on <TAB>: COMP_* set, '=' breaks words
  COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}
  read -r -a COMP_WORDS <<< "$(sed -E 's/=/ = /g' <<< "$COMP_LINE")"
  [[ "$COMP_LINE" =~ [[:space:]]$ ]] && COMP_WORDS+=("")
  COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
  _memlab_completion
  echo "${COMPREPLY[*]}"
}
"""


def complete(lines: list[str], *installer: str) -> list[str]:
    script = COMPLETE + "".join(f"complete_line {json.dumps(line)}\n" for line in lines)
    r = subprocess.run(["bash", "-c", script, "bash", *installer], env=ENV, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_tab_completion_for_memlab_and_python_m_memlab():
    python = "python" if Path(sys.executable).name == "python" else sys.executable
    got = complete(["python -m memlab peft=", "python -m memlab peft=ql",
                    "python -m memlab estimate packing=b", "python -m memlab -m sweep=pa",
                    "python -m memlab "], python, "-m", "memlab")
    assert got[0].split() == ["=lora", "=none", "=qlora"]  # bash replaces the word "="
    assert got[1] == "qlora"
    assert got[2].split() == ["bfd", "bfd_split"]
    assert got[3] == "packing"
    assert {"report", "estimate", "lengths", "fit", "peft=", "method="} <= set(got[4].split())
    exe = Path(sys.executable).with_name("memlab")
    if not exe.exists():
        pytest.skip("no memlab console script beside this python (pip install -e .)")
    assert complete(["memlab peft="], str(exe))[0].split() == ["=lora", "=none", "=qlora"]


def test_estimate_sweeps_with_hydra_grammar_into_hydra_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAB_CPU_BF16", "0")  # checks no precision: as on any CPU
    r = memlab("estimate", "-m", *TINY, "method.max_length=range(32,65,32)", "peft=glob(l*)",
               "--budget", "1GiB", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["multirun"]
    (sweep,) = (tmp_path / "multirun" / "estimate").glob("*/*")
    points = json.loads((sweep / "sweep.json").read_text())["points"]
    assert [p["sweep_point"] for p in points] == [["method.max_length=32"],
                                                   ["method.max_length=64"]]
    ests = [json.loads((sweep / str(i) / "estimate.json").read_text()) for i in (0, 1)]
    assert all(e["status"] == "ok" and e["choices"]["peft"] == "lora" for e in ests)
    assert ests[0]["peak_bytes"] < ests[1]["peak_bytes"]
    assert (sweep / "0" / ".hydra" / "overrides.yaml").exists()
    rows = [line.split() for line in r.stdout.splitlines()]
    assert rows[0][0] == "method.max_length" and [row[0] for row in rows[1:3]] == ["32", "64"]
    assert "fits" in r.stdout and "[memlab] jobs: 100%" in r.stderr  # the bar, not a line a point


def test_lengths_takes_overrides_sweeps_and_hydra_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAB_CPU_BF16", "0")  # checks no precision: as on any CPU
    args = ["lengths", "data.n_examples=40", "--no-plot", "--candidates", "256,1024",
            "--num-proc", "1"]
    r = memlab(*args, "hydra.run.dir=here", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "here" / "lengths.json").read_text())["stats"]["count"] == 40
    r = memlab(*args[:1], "-m", "data.n_examples=choice(20,30)", *args[2:], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "multirun"]
    (sweep,) = (tmp_path / "multirun" / "lengths").glob("*/*")
    counts = [json.loads((sweep / str(i) / "lengths.json").read_text())["stats"]["count"]
              for i in (0, 1)]
    assert counts == [20, 30]
    r = memlab(*args[:2], "--no-plot", cwd=tmp_path)  # the default: outputs/lengths/<date>/<time>
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list((tmp_path / "outputs" / "lengths").glob("*/*/lengths.json"))) == 1
