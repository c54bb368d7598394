"""Installed = checkout: memlab built as a wheel, installed into a fresh virtual environment and
run from another directory, with no source tree anywhere on its path; and an editable install
(``pip install -e .``) of a copy of the tree, run from another directory too.

The environment's only memlab is the wheel's. Its dependencies (torch, transformers, Hydra...)
come from the developer environment through a plain path entry (a ``.pth`` line: that
environment's own ``.pth`` files, among them the editable memlab, are not processed), so the
test costs seconds instead of a torch download; the test checks where memlab was imported from.
From a fresh directory it then runs what a new user runs (at the default precision, auto): a
2-job smoke sweep through memlab's isolating launcher, ``memlab report``, ``memlab estimate``
and ``memlab lengths`` (each into Hydra-style dirs, nothing else in the directory), a ready
sweep and a user's own config dir composed by name, ``--version``, and tab completion through
the installed console script.
The editable install (same cheap environment) serves the copy's top-level ``conf/`` and
``sweeps/``: a sweep added there after the install runs by name, Hydra finds memlab's plugins
(its launcher, the ``sweep`` group's mount), a user's config dir composes on top.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from memlab_testing import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=1",
        "model.num_heads=4", "model.num_kv_heads=2", "train.batch_size=2",
        "method.max_length=64", "data.n_examples=24", "train.progress=false"]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def _tree(root: Path) -> Path:
    """A copy of what a build reads (code, configs, ready sweeps, metadata) under ``root``."""
    tree = root / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in ("src", "conf", "sweeps"):
        shutil.copytree(REPO / name, tree / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, tree / name)
    return tree


def _venv(root: Path, env: dict[str, str], install: list[str]) -> dict[str, Path]:
    """A fresh venv under ``root`` with memlab installed by ``pip install --no-deps <install>``
    and the developer environment's packages as its dependencies; returns paths."""
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig."
                                   "get_paths()['purelib'])"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    # the dependencies, as a plain path entry (its .pth files, the editable memlab's among them,
    # are not processed); after the venv's own site-packages, where memlab goes
    (purelib / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
          "--no-index", "--no-build-isolation", *install], root, env)
    work = root / "elsewhere"
    work.mkdir()
    return {"py": py, "memlab": venv / "bin" / "memlab", "work": work, "purelib": purelib}


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """Build the wheel from a copy of the tree, install it into a fresh venv; returns paths."""
    root = tmp_path_factory.mktemp("install")
    tree = _tree(root)
    env = _env(root / "venv")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(root / "dist"), str(tree)], root, env)
    (wheel,) = (root / "dist").glob("memlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for member in ("memlab/conf/config.yaml", "memlab/sweeps/packing.yaml",
                   "memlab/conf/debug/data/smoke_local.yaml",
                   "memlab/conf/hydra/launcher/local_gpus.yaml", "memlab/assets/tokenizer/"
                   "tokenizer.json", "memlab/assets/summary.schema.json",
                   "hydra_plugins/memlab_launcher/worker.py",
                   "hydra_plugins/memlab_sweeps/memlab_sweeps.py"):
        assert member in names, member
    return {**_venv(root, env, [str(wheel)]), "env": env}


@pytest.mark.auto_precision("what a new user runs: the default precision, as installed")
def test_installed_memlab_runs_without_the_source_tree(installed):
    py, exe, work, env = (installed[k] for k in ("py", "memlab", "work", "env"))
    probe = _run([str(py), "-c", "import sys, memlab, hydra_plugins.memlab_launcher as l; "
                  "print(memlab.__file__); print(l.__file__); print(sys.path)"],
                 work, env).stdout.splitlines()
    purelib = str(installed["purelib"])
    assert probe[0].startswith(purelib) and probe[1].startswith(purelib), probe
    deps = sysconfig.get_paths()["purelib"]  # the dependencies' entry (a .venv may sit in REPO)
    assert not any(p.startswith(str(REPO)) and p != deps
                   for p in eval(probe[2])), probe[2]  # noqa: S307

    assert _run([str(exe), "--version"], work, env).stdout.startswith("memlab ")
    hydra = _run([str(exe), "--cfg", "hydra", "sweep=packing"], work, env).stdout
    assert "packing: none,bfd,bfd_split,wrapped" in hydra  # a ready sweep by name, from anywhere
    where = _run([str(exe), "--info", "searchpath"], work, env).stdout
    assert f"file://{purelib}/memlab/conf " in where, where
    assert f"memlab://sweep={purelib}/memlab/sweeps " in where, where
    (work / "mine" / "sweep").mkdir(parents=True)
    (work / "mine" / "sweep" / "mine.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      peft: none,lora\n")
    hydra = _run([str(exe), "--config-dir", "mine", "--cfg", "hydra", "sweep=mine"], work,
                 env).stdout
    assert "peft: none,lora" in hydra
    shutil.rmtree(work / "mine")

    # smoke runs: a 2-job sweep through memlab's isolating launcher (fresh processes; a lone
    # run goes through the same app and task as estimate and lengths below)
    # 4 steps: a tracked one, then 3 timed (a throughput plot needs >= 3 timed steps a job)
    _run([str(exe), "-m", "debug=smoke", *TINY, "train.steps=4", "measure.memory_steps=1",
          "train.seed=0,1"], work, env)
    (sweep,) = (work / "multirun").glob("*/*")
    jobs = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [j["status"] for j in jobs] == ["ok", "ok"]
    assert [j["train"]["steps"] for j in jobs] == [4, 4]
    assert oct((sweep / "0" / "summary.json").stat().st_mode & 0o777) == "0o644"
    assert jobs[0]["train"]["loss_curve"] != jobs[1]["train"]["loss_curve"]  # seeds 0 and 1
    report = _run([str(exe), "report", str(sweep), "--html"], work, env).stdout
    assert "train.seed" in report and (sweep / "report.html").exists()
    assert (sweep / "memory_vs_throughput.png").stat().st_size > 1000

    est = _run([str(exe), "estimate", *TINY, "--budget", "1GiB"], work, env, timeout=400)
    assert "estimated peak:" in est.stdout
    (est_json,) = (work / "outputs" / "estimate").glob("*/*/estimate.json")
    assert json.loads(est_json.read_text())["verdict"]["fits"]
    _run([str(exe), "lengths", "data.n_examples=40", "--no-plot", "--num-proc", "1"], work, env)
    (lengths,) = (work / "outputs" / "lengths").glob("*/*/lengths.json")
    assert json.loads(lengths.read_text())["stats"]["count"] == 40
    assert sorted(p.name for p in work.iterdir()) == ["multirun", "outputs"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_installed_console_script_completes(installed):
    script = ('source <(memlab -sc install=bash)\nCOMP_LINE="memlab peft="; '
              "COMP_POINT=${#COMP_LINE}; COMP_WORDS=(memlab peft =); COMP_CWORD=2\n"
              '_memlab_completion; echo "${COMPREPLY[*]}"\n')
    r = _run(["bash", "-c", script], installed["work"], installed["env"])
    assert r.stdout.split() == ["=lora", "=none", "=qlora"]


def test_editable_install_serves_the_checkouts_conf_and_sweeps(tmp_path):
    """``pip install -e .`` of a copy of the tree, run from another directory: memlab and its
    configs come from the copy (a sweep added to its sweeps/ after the install runs by name),
    Hydra discovers memlab's plugins (hydra/launcher=memlab, the sweep group), a user's own
    config dir composes on top."""
    tree = _tree(tmp_path)
    env = _env(tmp_path / "venv")
    inst = _venv(tmp_path, env, ["-e", str(tree)])
    py, exe, work = inst["py"], inst["memlab"], inst["work"]
    assert not list(inst["purelib"].glob("memlab*/conf"))  # nothing copied: the tree is read
    (tree / "sweeps" / "added.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      peft: none,qlora\n")
    (work / "mine" / "sweep").mkdir(parents=True)
    (work / "mine" / "sweep" / "mine.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      peft: none,lora\n")

    probe = _run([str(py), "-c", "import memlab; print(memlab.__file__)"], work, env).stdout
    assert probe.startswith(str(tree / "src" / "memlab")), probe
    where = _run([str(exe), "--config-dir", "mine", "--info", "searchpath"], work, env).stdout
    rows = [line.split("|")[1:3] for line in where.splitlines() if line.startswith("|")]
    assert [[c.strip() for c in r] for r in rows[1:]] == [
        ["hydra", "pkg://hydra.conf"], ["main", f"file://{tree / 'conf'}"],
        ["memlab", f"memlab://sweep={tree / 'sweeps'}"],
        ["command-line", f"file://{work / 'mine'}"], ["schema", "structured://"]], where
    hydra = _run([str(exe), "--config-dir", "mine", "--cfg", "hydra", "sweep=added"], work,
                 env).stdout
    assert "peft: none,qlora" in hydra  # the tree's sweeps/, as it is now
    assert "_target_: hydra_plugins.memlab_launcher.memlab_launcher.MemlabLauncher" in hydra
    hydra = _run([str(exe), "--config-dir", "mine", "--cfg", "hydra", "sweep=mine"], work,
                 env).stdout
    assert "peft: none,lora" in hydra
    helped = _run([str(exe), "--help"], work, env).stdout
    assert "sweep: added, data_parallel, dpo_packing, foundation" in helped
    assert sorted(p.name for p in work.iterdir()) == ["mine"]
