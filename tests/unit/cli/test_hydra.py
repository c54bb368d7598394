"""Hydra conventions, in-process: ``debug=smoke`` composes and validates with every method and
every data source; the ready sweeps (sweeps/) are the config group ``sweep`` beside conf/; the dispatcher's
flags (``--version``, completion install) and the Hydra command line estimate/lengths build."""

from __future__ import annotations

import itertools

import pytest

from memlab_testing import CONF, SWEEPS, compose

pytestmark = pytest.mark.usefixtures("no_cpu_bf16")

METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))


def _plain(cfg):
    from omegaconf import OmegaConf, open_dict

    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.create(OmegaConf.to_container(cfg))


@pytest.mark.parametrize(("method", "data"), list(itertools.product(METHODS, DATA)))
def test_debug_smoke_composes_with_every_method_and_data_source(method, data, tmp_path):
    from memlab.context import validate

    assert len(METHODS) >= 9 and DATA == ["embedded", "hub", "local", "mixture"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    extra = {"local": [f"data.path={rows}"],
             "mixture": [f"+data.sources.a={{name: local, path: '{rows}', weight: 1}}"]
             }.get(data, [])
    cfg = compose(["debug=smoke", f"method={method}", f"data={data}", *extra])
    ctx = validate(_plain(cfg))
    assert ctx.train.steps == 4 and ctx.train.device == "cpu"
    size = getattr(ctx.data, "n_examples", None) or getattr(ctx.data, "max_examples", None)
    assert size == 64
    lengths = [getattr(ctx.method, k, None) for k in ("max_length", "max_completion_length")]
    assert any(v is not None and v <= 256 for v in lengths), lengths


def test_smoke_slices_exist_for_every_option():
    """A new method or data source needs its debug/{method,data}/smoke_<name>.yaml: without it
    debug=smoke would silently run it at full size."""
    assert sorted(p.stem for p in (CONF / "debug" / "method").glob("*.yaml")) == \
        [f"smoke_{m}" for m in METHODS]
    assert sorted(p.stem for p in (CONF / "debug" / "data").glob("*.yaml")) == \
        [f"smoke_{d}" for d in DATA]


def test_ready_sweeps_are_the_sweep_group_beside_conf():
    """The editable install serves the checkout's conf/ and sweeps/; sweeps/ is the group
    ``sweep``, mounted right after conf/ (hydra_plugins/memlab_sweeps), every file an option."""
    from memlab.cli.compose import compose as memlab_compose
    from memlab.cli.compose import conf_dir, sweeps_dir

    assert conf_dir() == CONF.resolve() and sweeps_dir() == SWEEPS.resolve()
    assert not (CONF / "sweep").exists()
    cfg, choices = memlab_compose(["sweep=packing"])
    assert choices["sweep"] == "packing" and cfg.train.steps == 16
    assert not any("/" in k or "@" in k for k in choices)
    hydra = compose(["sweep=zero"]).hydra
    assert dict(hydra.sweeper.params)["distributed.zero_stage"] == "0,1,2,3"
    sources = [(s.provider, s.path) for s in hydra.runtime.config_sources]
    main = sources.index(("main", str(CONF.resolve())))
    assert sources[main + 1] == ("memlab", f"sweep={SWEEPS.resolve()}")

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    with _initialized(CONF):
        repo = GlobalHydra.instance().config_loader().repository
        assert repo.get_group_options("sweep", ObjectType.CONFIG) == sorted(
            p.stem for p in SWEEPS.glob("*.yaml"))


def test_sweeps_are_mounted_only_beside_memlabs_configs(tmp_path):
    """Another Hydra app (another primary config dir) gets no ``sweep`` group from memlab."""
    from hydra.core.global_hydra import GlobalHydra

    (tmp_path / "config.yaml").write_text("x: 1\n")
    with _initialized(tmp_path):
        loader = GlobalHydra.instance().config_loader()
        paths = [e.path for e in loader.get_sources()]
    assert not any(p.startswith("memlab://") for p in paths), paths


def _initialized(config_dir):
    from hydra import initialize_config_dir

    return initialize_config_dir(config_dir=str(config_dir), version_base="1.3")


def test_user_config_dir_composes_on_top(tmp_path):
    """A user's own sweep in their own config dir, added by ``hydra.searchpath`` (what
    ``--config-dir`` does on the command line: tests/integration/test_install.py runs that)."""
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "mine.yaml").write_text(
        "# @package _global_\ntrain:\n  steps: 7\nhydra:\n  sweeper:\n    params:\n"
        "      peft: none,lora\n")
    cfg = compose([f"hydra.searchpath=[file://{tmp_path}]", "sweep=mine", "peft=lora"])
    assert cfg.train.steps == 7 and cfg.peft.name == "lora"
    assert cfg.hydra.sweeper.params.peft == "none,lora"
    assert cfg.hydra.runtime.choices.sweep == "mine"


def test_version_and_dispatch(capsys):
    from importlib.metadata import version

    import memlab
    from memlab.cli.main import completion_request, dispatch, main, single_run_of_a_sweep

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"memlab {memlab.__version__} ") and "Hydra 1.3" in out
    assert memlab.__version__ == version("memlab")
    assert dispatch(["mode=estimate", "a=1"]) == ("memlab.cli.estimate", ["a=1"])
    with pytest.raises(ValueError, match="mode=estimate"):
        dispatch(["mode=nope"])
    assert completion_request(["-sc", "install=bash"]) == ("install", "bash")
    assert completion_request(["--shell-completion", "uninstall=zsh"]) == ("uninstall", "zsh")
    assert completion_request(["-sc", "query=bash"]) is None  # Hydra answers queries
    assert main(["sweep=packing", "debug=smoke"]) == 2
    assert "run it with -m (memlab -m sweep=packing debug=smoke)" in capsys.readouterr().err
    assert single_run_of_a_sweep(["-m", "sweep=packing"]) is None
    assert single_run_of_a_sweep(["sweep=packing", "--cfg", "job"]) is None


def test_estimate_and_lengths_hydra_command_lines(tmp_path):
    from memlab.cli.compose import app_argv, split_hydra_flags

    hydra, rest = split_hydra_flags(["-m", "peft=none,lora", "--cfg", "job", "-cd", "d"])
    assert hydra == ["-m", "--cfg", "job", "-cd", "d"] and rest == ["peft=none,lora"]
    argv = app_argv(["peft=lora"], "estimate")
    assert "hydra.run.dir=outputs/estimate/${now:%Y-%m-%d}/${now:%H-%M-%S}" in argv
    assert "hydra.sweep.dir=multirun/estimate/${now:%Y-%m-%d}/${now:%H-%M-%S}" in argv
    assert "hydra/launcher=basic" in argv and argv[-1] == "peft=lora"
    mine = app_argv(["hydra.run.dir=x", "hydra/launcher=memlab"], "lengths")
    assert not any(a.startswith("hydra.run.dir=outputs") for a in mine)
    assert "hydra/launcher=basic" not in mine
    out = app_argv([], "lengths", tmp_path / "it's here")
    assert out[0] == f"hydra.run.dir='{tmp_path}/it\\'s here'"
