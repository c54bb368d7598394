"""Where memlab's configs live (the repo's ``conf/`` and ``sweeps/``, or the wheel's copies),
Hydra initialised on them outside a Hydra app, and a command line split into Hydra's flags and the
rest: what composing a config (:mod:`memlab.cli.compose`) and checking the command line's
overrides before it (:mod:`memlab.cli.overrides`) both start from."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

HYDRA_FLAGS_WITH_VALUE = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                          "--cfg", "-c", "--package", "-p", "--info", "-i",
                          "--shell-completion", "-sc", "--experimental-rerun")
"""Hydra's flags that take the next argument as their value (``--cfg job``, ``-cd DIR``)."""


def _shipped_dir(name: str, marker: str | None = None) -> Path:
    """The directory ``name`` of memlab's layout (``conf`` or ``sweeps``): inside the package in an
    installed wheel (``memlab/<name>``, placed there by the build: pyproject.toml's
    ``[tool.hatch.build.targets.wheel]``), else the checkout's top-level ``<name>/`` beside
    ``src/memlab`` (an editable install, ``pip install -e .``, imports memlab from ``src/``).
    ``marker``, when given, must be in it (a leftover ``src/memlab/conf/__pycache__`` of the old
    layout is no config dir)."""
    import memlab

    package = Path(memlab.__file__).resolve().parent
    places = [package / name]
    if package.parent.name == "src":
        places.append(package.parents[1] / name)
    for where in places:
        if (where / marker).is_file() if marker else where.is_dir():
            return where
    raise FileNotFoundError(
        f"memlab's {name}/ is in none of {', '.join(map(str, places))} (memlab imported from "
        f"{package}): a wheel holds it as memlab/{name}, a checkout at its top level; "
        f"reinstall memlab (pip install -e . in a checkout)")


def conf_dir() -> Path:
    """memlab's configs: ``config.yaml`` and one dir per config group (the repo's ``conf/``). Hydra
    reads it as an absolute config dir (:data:`memlab.cli.app.CONFIG_PATH`, :func:`compose`)."""
    return _shipped_dir("conf", "config.yaml")


def sweeps_dir() -> Path:
    """The ready sweeps (the repo's ``sweeps/``), the config group ``sweep`` of every search path
    that holds :func:`conf_dir` (``hydra_plugins/memlab_sweeps`` mounts it)."""
    return _shipped_dir("sweeps")


def initialize():
    """Hydra initialised on memlab's configs (:func:`conf_dir`; the sweeps mounted beside them),
    for code that reads the config tree outside a Hydra app (a context manager)."""
    from hydra import initialize_config_dir

    return initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3")


def split_hydra_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, everything else) so that a command's own argparse
    never sees ``--cfg job`` or ``-cd DIR``."""
    hydra_args, rest = [], []
    it = iter(argv)
    for arg in it:
        if arg in HYDRA_FLAGS_WITH_VALUE:
            hydra_args.append(arg)
            value = next(it, None)
            if value is not None:
                hydra_args.append(value)
        elif arg in ("-m", "--multirun", "--run", "-r", "--resolve", "--hydra-help"):
            hydra_args.append(arg)
        else:
            rest.append(arg)
    return hydra_args, rest
