"""memlab's configs for the commands beside a run: where they live, composing them outside a Hydra
app (the same config a run with the same overrides gets), and the command line with which
``memlab estimate`` / ``memlab lengths`` run as Hydra apps of their own."""

from __future__ import annotations

import argparse
import sys
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


def compose(overrides: Sequence[str]):
    """(config without the hydra node, the user's group choices) composed from memlab's configs
    with ``overrides``, exactly as a run composes them."""
    from hydra import compose as hydra_compose
    from omegaconf import OmegaConf, open_dict

    from memlab.measure.summary import user_choices

    with initialize():
        cfg = hydra_compose(config_name="config", overrides=list(overrides),
                            return_hydra_config=True)
    choices = user_choices(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.create(OmegaConf.to_container(cfg)), choices


def _quote(value: str) -> str:
    """``value`` as a quoted Hydra override value (any character allowed)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def app_argv(args: Sequence[str], command: str, out: Path | None = None) -> list[str]:
    """The Hydra command line of ``memlab <command>`` from what the user typed after it (its own
    options already removed): the outputs go to ``--out`` when given, else to Hydra's usual
    places (``hydra.run.dir`` / ``hydra.sweep.dir`` when the user sets them) under
    ``outputs/<command>/<date>/<time>`` and ``multirun/<command>/<date>/<time>``; a sweep (-m)
    runs its points in this process (Hydra's basic launcher) unless a launcher is chosen."""
    args = list(args)
    keys = {a.lstrip("+").split("=", 1)[0] for a in args if "=" in a and not a.startswith("-")}
    extra = []
    if out is not None:
        extra += [f"hydra.run.dir={_quote(str(out))}", f"hydra.sweep.dir={_quote(str(out))}"]
    else:
        stamp = "${now:%Y-%m-%d}/${now:%H-%M-%S}"
        if "hydra.run.dir" not in keys:
            extra.append(f"hydra.run.dir=outputs/{command}/{stamp}")
        if "hydra.sweep.dir" not in keys:
            extra.append(f"hydra.sweep.dir=multirun/{command}/{stamp}")
    if "hydra/launcher" not in keys:
        extra.append("hydra/launcher=basic")
    return [*extra, *args]


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


def parse_command(argv: Sequence[str] | None, parser: argparse.ArgumentParser, prog: str
                  ) -> tuple[list[str], argparse.Namespace, list[str]] | None:
    """A subcommand's command line: ``(Hydra's flags, this command's options, the overrides)``,
    or None after printing the usage for an unknown ``--option`` (the caller exits 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    hydra_args, rest = split_hydra_flags(argv)
    args, rest = parser.parse_known_args(rest)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        parser.print_usage(sys.stderr)
        print(f"{prog}: unknown option(s): {' '.join(unknown)}", file=sys.stderr)
        return None
    from memlab.config import moved_overrides

    moved = moved_overrides(rest)
    if moved:
        print("\n".join(f"{prog}: {m}" for m in moved), file=sys.stderr)
        return None
    return hydra_args, args, rest
