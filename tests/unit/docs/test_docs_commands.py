"""Every memlab command shown in the docs still parses; nothing is run.

The commands are the ``memlab ...`` / ``python -m memlab ...`` lines (and ``torchrun ... -m memlab
...``) of the fenced ``bash`` / ``sh`` / ``console`` blocks of README.md, docs/**/*.md and the
experiments' write-ups (the site shows them too). A training line's overrides are composed with
memlab's configs exactly as a run composes them (``memlab.cli.compose``), then every group node
is typed by its registered dataclass (types and ranges), without the cross-group validation (a
GPU-only line is valid on a GPU). A sweep (``-m``) is expanded as Hydra's basic sweeper expands
it, ready sweeps' ``hydra.sweeper.params`` included, and every value of every swept key is
composed at least once. ``memlab estimate`` / ``fit`` / ``lengths`` / ``report`` /
``vllm-serve`` lines are parsed by the command's own parser, their overrides composed the same
way. A bare ``...`` stands for elided arguments and is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from memlab_testing import REPO

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```",
                   re.M | re.S)
SHELL = ("bash", "sh", "shell", "console")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SUBCOMMANDS = ("estimate", "fit", "lengths", "report", "data", "vllm-serve")
FOR = re.compile(r"^\s*for (\w+) in (\S+)[^;]*; do\s*$")
"""``for X in a b c; do``: X is its first value in the lines that follow."""
VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")
PLACEHOLDER = re.compile(r"<([A-Za-z_][\w.-]*)>")
"""``<date>``, ``<checkpoint_dir>``: a value the reader fills in (not a redirection)."""


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")),
            *sorted((REPO / "experiments").glob("*/README.md"))]


@dataclass(frozen=True)
class Command:
    where: str
    """file:line of the command's first line."""
    args: tuple[str, ...]
    """What follows ``memlab`` (or ``python -m memlab``)."""
    error: str = ""
    """Why the line could not be read as shell words (unbalanced quotes)."""


def extract(text: str, name: str = "<text>") -> list[Command]:
    """The memlab commands of the fenced shell blocks of a Markdown text."""
    out = []
    for block in FENCE.finditer(text):
        if block["lang"] not in SHELL:
            continue
        first = text.count("\n", 0, block.start("body")) + 1
        lines = textwrap.dedent(block["body"]).split("\n")
        loop: dict[str, str] = {}  # for X in a b c; do: X is its first value
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            if m := FOR.match(line):
                loop[m[1]] = m[2]
                continue
            line = expand_variables(line, loop)
            if block["lang"] == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            where = f"{name}:{first + start}"
            try:
                args = memlab_args(line)
            except ValueError as e:
                if "memlab" in line:
                    out.append(Command(where, (), f"not shell words ({e}): {line}"))
                continue
            if args is not None:
                out.append(Command(where, tuple(args)))
    return out


def expand_variables(line: str, values: dict[str, str]) -> str:
    """``$X`` / ``${X}`` replaced where ``values`` has X (others left: the check names them)."""
    return VARIABLE.sub(lambda v: values.get(v[1] or v[2], v[0]), line)


def words(line: str) -> list[str]:
    """The shell words of ``line`` up to its first operator (``>``, ``|``, ``;``, ``&&``);
    a ``<placeholder>`` stands for a value (its name)."""
    lexer = shlex.shlex(PLACEHOLDER.sub(r"\1", line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = []
    for token in lexer:
        if token and all(ch in "();<>|&" for ch in token):
            if tokens and tokens[-1].isdigit():  # 2>&1: the fd
                tokens.pop()
            break
        tokens.append(token)
    return tokens


def memlab_args(line: str) -> list[str] | None:
    """The arguments after ``memlab`` in a shell line, or None when it runs something else;
    ValueError when the line is not shell words."""
    tokens = words(line)
    while tokens and ENV.match(tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "memlab":
        rest = tokens[1:]
    elif Path(tokens[0]).name.startswith(("python", "torchrun")) and "-m" in tokens:
        i = tokens.index("-m")
        if tokens[i + 1:i + 2] != ["memlab"]:
            return None
        rest = tokens[i + 2:]
    else:
        return None
    return [t for t in rest if t != "..."]


# ------------------------------------------------------------------------- checking a command

class Bad(Exception):
    """The command does not parse; the message says why."""


def check(args: list[str]) -> None:
    """Raise :class:`Bad` unless ``memlab *args`` parses; nothing runs."""
    from memlab.cli.main import completion_request, dispatch, single_run_of_a_sweep

    unset = [a for a in args if re.search(r"\$\w", a)]
    if unset:
        raise Bad(f"shell variable(s) the docs do not set in a `for` line: {unset}")
    if args and args[0] in SUBCOMMANDS:
        return check_subcommand(args[0], args[1:])
    if "--version" in args or completion_request(args) is not None:
        return None
    try:
        module, rest = dispatch(args)
    except ValueError as e:
        raise Bad(str(e)) from None
    if module is not None:  # mode=estimate / lengths / fit
        return check_subcommand(module.rsplit(".", 1)[1], rest)
    err = single_run_of_a_sweep(rest)
    if err:
        raise Bad(err)
    from memlab.cli.compose import split_hydra_flags

    hydra_args, overrides = split_hydra_flags(rest)
    overrides = [a for a in overrides if a not in ("--help", "-h")]
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        raise Bad(f"unknown flag(s) {flags}")
    check_overrides(hydra_args, overrides)


def parse_or_bad(parser: argparse.ArgumentParser, args: list[str], known: bool = False):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_known_args(args) if known else parser.parse_args(args)
    except SystemExit:
        raise Bad(err.getvalue().strip()) from None


def check_subcommand(name: str, args: list[str]) -> None:
    if name == "report":
        from memlab.cli.report import build_parser

        parse_or_bad(build_parser(), args)
        return
    if name == "vllm-serve":
        from memlab.generation.vllm_server import parse
        from memlab.registry import ConfigErrors

        try:
            parse(args)
        except ConfigErrors as e:
            raise Bad(str(e)) from None
        return
    from memlab.cli.compose import split_hydra_flags

    hydra_args, rest = split_hydra_flags(args)
    if name == "fit":
        from memlab.cli.fit import build_parser, options

        ns, rest = parse_or_bad(build_parser(), rest, known=True)
        convert = options
    elif name == "data":
        from memlab.cli.data import build_parser

        ns, rest = parse_or_bad(build_parser(), rest, known=True)
        convert = None
    elif name == "estimate":
        from memlab.cli.estimate import build_parser, options_from

        ns, rest = parse_or_bad(build_parser(), rest, known=True)
        convert = options_from
    else:
        from memlab.cli.lengths import build_parser

        ns, rest = parse_or_bad(build_parser(), rest, known=True)
        convert = None
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        raise Bad(f"memlab {name}: unknown option(s) {flags}")
    if convert is not None and not getattr(ns, "cards", False):
        try:
            convert(ns)
        except ValueError as e:
            raise Bad(f"memlab {name}: {e}") from None
    check_overrides(hydra_args, rest)


def check_overrides(hydra_args: list[str], overrides: list[str]) -> None:
    """Compose every job the overrides describe (one, or a sweep's) and type its groups."""
    hydra_args = list(hydra_args)
    for flag in ("--config-dir", "-cd"):
        while flag in hydra_args:
            i = hydra_args.index(flag)
            path = Path(hydra_args[i + 1])
            path = path if path.is_absolute() else REPO / path
            if not path.is_dir():
                raise Bad(f"{flag} {hydra_args[i + 1]}: no such directory")
            overrides = [f"hydra.searchpath=[file://{path}]", *overrides]
            del hydra_args[i:i + 2]
    multirun = "-m" in hydra_args or "--multirun" in hydra_args
    try:
        for job in jobs(overrides, multirun):
            typed(job)
    except Bad:
        raise
    except Exception as e:  # noqa: BLE001 - Hydra's and OmegaConf's errors: the reason
        raise Bad(f"{type(e).__name__}: {e}") from None


def jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The jobs to compose: the overrides themselves, or a sweep's jobs such that every value
    of every swept key is in one of them (job i takes the i-th value of each key, cycling)."""
    if not multirun:
        return [overrides]
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from memlab.cli.compose import initialize

    with initialize():
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        fixed = [o.input_line for o in parser.parse_overrides(overrides)
                 if not o.is_sweep_override()]
        cfg = compose(config_name="config", overrides=fixed, return_hydra_config=True)
        params = dict(cfg.hydra.sweeper.params or {})
        values: dict[str, list[str]] = {}
        for o in parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides):
            key = o.get_key_element()
            values[key] = ([f"{key}={v}" for v in o.sweep_string_iterator()]
                           if o.is_sweep_override() else [o.input_line])
            if not values[key]:
                raise Bad(f"{o.input_line}: the sweep has no values")
    n = max((len(v) for v in values.values()), default=1)
    return [[v[i % len(v)] for v in values.values()] for i in range(n)]


@functools.cache
def group_options(group: str) -> list[str]:
    """The options Hydra finds for a group of memlab's configs (sweep, experiment, debug)."""
    from hydra.core.global_hydra import GlobalHydra

    from memlab.cli.compose import initialize

    with initialize():
        return GlobalHydra.instance().config_loader().get_group_options(group)


@functools.cache
def _typed(overrides: tuple[str, ...]) -> str:
    try:
        typed_now(list(overrides))
    except Exception as e:  # noqa: BLE001 - remembered, raised again for each command
        return f"{type(e).__name__}: {e}" if not isinstance(e, Bad) else str(e)
    return ""


def typed(overrides: list[str]) -> None:
    """:func:`typed_now`, once per distinct job (many commands share one)."""
    err = _typed(tuple(overrides))
    if err:
        raise Bad(err)


def typed_now(overrides: list[str]) -> None:
    """Compose as a run does, then build every group's typed config (types, ranges, keys)."""
    from omegaconf import OmegaConf

    from memlab import config, registry
    from memlab.cli.compose import compose

    cfg, choices = compose(overrides)
    plain = OmegaConf.to_container(cfg, resolve=True)
    errors = []
    for group, option in choices.items():  # Hydra skips a missing option of an optional group
        if group not in registry.GROUPS and option not in group_options(group):
            errors.append(f"{group}={option} is not an option; choose one of: "
                          f"{', '.join(group_options(group))}")
    for group in registry.GROUPS:
        errors += registry.build(group, plain[group])[1]
    errors += registry.from_mapping(config.TrainConfig, plain["train"], "train")[1]
    errors += registry.from_mapping(config.MeasureConfig, plain["measure"], "measure")[1]
    if errors:
        raise Bad("; ".join(errors))


# ------------------------------------------------------------------------------------ the tests

COMMANDS = [c for path in doc_files()
            for c in extract(path.read_text(), str(path.relative_to(REPO)))]


def test_the_docs_show_commands_of_every_kind():
    kinds = {c.args[0] if c.args and c.args[0] in SUBCOMMANDS else
             "sweep" if "-m" in c.args else "run" for c in COMMANDS}
    assert kinds >= {"run", "sweep", *SUBCOMMANDS}, kinds
    assert len(COMMANDS) >= 60, len(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.where)
def test_docs_command_parses(command):
    assert not command.error, f"{command.where}: {command.error}"
    try:
        check(list(command.args))
    except Bad as e:
        pytest.fail(f"{command.where}: memlab {shlex.join(command.args)}\n  does not parse: {e}")


def test_extract_reads_shell_blocks_only():
    text = """
```bash
memlab packing=bfd   # a comment
OMP_NUM_THREADS=1 python -m memlab estimate -m peft=none,lora \\
  --budget 24GiB
torchrun --nproc_per_node 2 -m memlab distributed=fsdp2 ...
make run
```

```console
$ memlab --version
memlab 0.1 (not a command: output)
```

```text
memlab run: output, not a command
```
"""
    found = [c.args for c in extract(text)]
    assert found == [("packing=bfd",), ("estimate", "-m", "peft=none,lora", "--budget", "24GiB"),
                     ("distributed=fsdp2",), ("--version",)]


@pytest.mark.parametrize("args", [
    "peft=lorra",                               # no such option
    "train.stepz=3",                            # no such key
    "train.lr=-1",                              # out of its range
    "method.loss_type=sigmoid",                 # a dpo knob under sft
    "peft=none,lora",                           # a sweep without -m
    "sweep=packing",                            # a ready sweep without -m
    "-m peft=none,lorra",                       # a bad value inside a sweep
    "-m sweep=nosuch",                          # no such ready sweep
    "experiment=nosuch",                        # no such experiment (Hydra would skip it)
    "--frobnicate packing=bfd",                 # no such flag
    "mode=estimat peft=lora",                   # no such mode
    "estimate --cardz rtx4090",                 # no such estimate flag
    "estimate --card rtx9999",                  # no such card
    "estimate --shard zero2 --zero-stage 3",    # flags that disagree
    "estimate peft=lorra --card rtx4090",       # a bad override of a subcommand
    "fit --budget 24GiB --allow everything",    # fit: a bad --allow
    "fit peft=lora",                            # fit: neither --budget nor --card
    "lengths --candidates x",                   # lengths: not a list of numbers
    "report",                                   # report: no path
    "vllm-serve modle=x",                       # vllm-serve: no such knob
])
def test_a_wrong_command_fails(args):
    with pytest.raises(Bad):
        check(shlex.split(args))


@pytest.mark.parametrize("args", [
    "peft=lora train.lr=1e-5",
    "-m sweep=packing debug=smoke",
    "estimate --card rtx4090 peft=lora",
    "fit --budget 1GiB --allow peft packing=bfd",
])
def test_the_same_commands_spelled_right_parse(args):
    check(shlex.split(args))
