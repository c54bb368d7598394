"""memlab's configs for the commands beside a run: composing them outside a Hydra
app (the same config a run with the same overrides gets), and the command line with which
``memlab estimate`` / ``memlab lengths`` run as Hydra apps of their own."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# conf_dir, sweeps_dir: imported from here too (memlab.cli.conf keeps them, for the overrides' check)
from memlab.cli.conf import conf_dir, initialize, split_hydra_flags, sweeps_dir  # noqa: F401


def compose(overrides: Sequence[str]):
    """(config without the hydra node, the user's group choices) composed from memlab's configs
    with ``overrides``, exactly as a run composes them. An unknown group option (which Hydra
    skips in an optional group) or key raises :class:`memlab.registry.ConfigErrors` naming the
    fix (:mod:`memlab.cli.overrides`); other Hydra errors are Hydra's."""
    from hydra import compose as hydra_compose
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    from memlab.cli.overrides import problems, unknown_choices
    from memlab.measure.summary import user_choices
    from memlab.registry import ConfigErrors

    try:
        with initialize():
            cfg = hydra_compose(config_name="config", overrides=list(overrides),
                                return_hydra_config=True)
            bad = unknown_choices(cfg.hydra.runtime.choices,
                                  GlobalHydra.instance().config_loader().get_group_options,
                                  overrides)
    except Exception:
        found = problems(overrides)  # memlab's message where Hydra would advise a '+'
        if found:
            raise ConfigErrors(found) from None
        raise
    if bad:
        raise ConfigErrors(bad)
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


def positive_int(text: str) -> int:
    """An argparse ``type=`` for an option that takes a whole number >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


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
    from memlab.cli.overrides import too_deep

    deep = too_deep(rest)
    if deep is not None:
        print(f"{prog}: {deep}", file=sys.stderr)
        return None
    return hydra_args, args, rest


def run_command(argv: Sequence[str] | None, parser: argparse.ArgumentParser, prog: str,
                body: Callable[[list[str], argparse.Namespace, list[str]], int]) -> int:
    """A subcommand (``memlab data``, ``memlab lengths``): tokenizers' own threads off, its
    command line parsed (:func:`parse_command`: 2 for a bad one), then ``body(Hydra's flags,
    its options, the overrides)``, whose exit status it returns."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parsed = parse_command(argv, parser, prog)
    if parsed is None:
        return 2
    return body(*parsed)
