"""The command line's overrides checked before Hydra composes them, so that a mistake is an error
naming its fix (exit 2) and nothing runs:

- a config group's option that does not exist (``experiment=nope``, ``debug=smok``,
  ``-m sweep=foundatoin``, ``method=dop``), every value of a sweep included. Hydra skips a
  missing option of an ``optional`` group (``experiment``, ``debug``, ``sweep``) without a word
  and runs the default; here every group is checked and the error lists its options;
- a key without ``+`` that the config does not have (``train.stepz=5``, ``method.max_lenght=512``,
  ``pef=lora``): Hydra's advice, to add it with ``+``, is the wrong fix; here it is memlab's
  "did you mean", and the names of transformers / TRL settings users type first point to
  memlab's (:func:`memlab.config.trl_hint`).

The same checks run where a config is composed without the command line's Hydra app
(:func:`memlab.cli.compose.compose`), and :func:`unknown_choices` runs on every job of a sweep
(the options a sweep file's ``hydra.sweeper.params`` name) in memlab's launcher.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

HYDRA_GROUPS = ("hydra",)
MAX_COMPOSES = 32
"""At most this many configs are composed to check the keys of a sweep (one per swept option)."""


def option_problem(group: str, value: str, choices: Sequence[str]) -> str:
    """The error for ``group=value`` when ``value`` is not one of ``choices``."""
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    hint = f"; did you mean {group}={close[0]}?" if close else ""
    return (f"{group}={value}: no such option{hint} (the options of {group}: "
            f"{', '.join(choices) or 'none'})")


def unknown_choices(choices: Mapping[str, Any], options: Callable[[str], list[str]],
                    overrides: Sequence[str]) -> list[str]:
    """Every group choice of a composed config (``hydra.runtime.choices``) set by one of
    ``overrides`` that names no option of its group (``options(group)``). Only an override can
    name a missing option and compose: Hydra refuses one in a defaults list, or in a group that
    is not ``optional``."""
    named = {o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o}
    out = []
    for group, value in choices.items():
        group = str(group)
        if value is None or group not in named or group in HYDRA_GROUPS:
            continue
        known = options(group)
        if str(value) not in known:
            out.append(option_problem(group, str(value), known))
    return out


def command_line_error(argv: Sequence[str]) -> str | None:
    """The error for every unknown group option and key of a Hydra command line (flags and
    overrides) at once (:func:`problems`); None when there is none, or ``argv`` only asks for
    help or completion."""
    if any(a in ("--help", "-h", "--hydra-help", "-sc", "--shell-completion") for a in argv):
        return None
    from memlab.registry import ConfigErrors

    deep = too_deep(argv)
    if deep is not None:
        return deep
    found = problems(argv)
    if not found:
        return None
    return str(ConfigErrors(found)).replace("configuration", "command line", 1)


def too_deep(args: Sequence[str]) -> str | None:
    """One line naming an override nested too deeply for Hydra's parser (a list of lists
    hundreds deep: its grammar recurses once per level), or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    overrides = _split(args)[1]
    try:  # one parse when every override parses; otherwise, one at a time, which is too deep
        parser.parse_overrides(overrides)
        return None
    except Exception:  # noqa: BLE001 - RecursionError, or malformed: told apart below
        pass
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except RecursionError:
            shown = override if len(override) <= 60 else override[:57] + "..."
            return (f"{shown}: nested too deeply to parse ({len(override)} characters); give "
                    "the value with fewer levels of brackets or braces")
        except Exception:  # noqa: BLE001 - malformed otherwise: Hydra's own message says where
            continue
    return None


def _split(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(``--config-dir`` values, the overrides) of a Hydra command line."""
    from memlab.cli.conf import split_hydra_flags

    flags, rest = split_hydra_flags(args)
    dirs = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f in ("--config-dir", "-cd")]
    dirs += [a.split("=", 1)[1] for a in rest if a.startswith("--config-dir=")]
    return dirs, [a for a in rest if not a.startswith("-")]


def problems(args: Sequence[str]) -> list[str]:
    """Every unknown group option and every unknown key (without ``+``) of the Hydra command
    line ``args`` (flags and overrides), each with its fix; empty when there is none, or when
    Hydra will reject the command line itself (a malformed override)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    dirs, overrides = _split(args)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - a malformed override: Hydra's own message says where
        return []
    from pathlib import Path

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    from memlab.cli.conf import initialize

    paths = [f"file://{Path(d).absolute()}" for d in dirs]
    for o in parsed:  # the user's own search path (its last value, as Hydra takes it)
        value = o.value()
        if o.key_or_group == "hydra.searchpath" and isinstance(value, list):
            paths = [str(v) for v in value] + [f"file://{Path(d).absolute()}" for d in dirs]
    search = [f"hydra.searchpath=[{','.join(paths)}]"] if paths else []
    with initialize():
        loader = GlobalHydra.instance().config_loader()
        groups = set(loader.get_group_options("", results_filter=ObjectType.GROUP,
                                              overrides=search)) - set(HYDRA_GROUPS)
        cache: dict[str, list[str]] = {}

        def options(group: str) -> list[str]:
            if group not in cache:
                cache[group] = loader.get_group_options(group, overrides=search)
            return cache[group]

        errors: list[str] = []
        unknown: set[str] = set()  # groups given an option they do not have
        chosen: list[list[str]] = []  # each group override: its options (a sweep's: several)
        fixed: list[str] = list(search)
        keys = []
        for o in parsed:
            key = o.key_or_group
            if o.is_hydra_override() or key.split("/")[0] in HYDRA_GROUPS:
                continue
            if key in groups and not o.is_delete():
                values = _values(o, options(key))
                bad = [v for v in values if v is not None and str(v) not in options(key)]
                errors += [option_problem(key, str(v), options(key)) for v in bad]
                unknown |= {key} if bad else set()
                good = [f"{o.get_key_element()}={'null' if v is None else v}" for v in values
                        if v not in bad]
                if good:
                    chosen.append(good)
            elif o.is_add() or o.is_force_add() or o.is_delete():
                fixed.append(_first(o))
            else:
                keys.append(o)
        keys = [o for o in keys if o.key_or_group.split(".")[0] not in unknown]
        if keys:  # composed with the options that exist
            base = [c[0] for c in chosen]
            variants = [base] + [[*base[:i], other, *base[i + 1:]]
                                 for i, c in enumerate(chosen) for other in c[1:]]
            errors += _key_problems(keys, [[*fixed, *v] for v in variants[:MAX_COMPOSES]],
                                    groups)
    return errors


def _values(o: Any, options: list[str]) -> list[Any]:
    """The option names an override of a group gives (each value of a sweep)."""
    from hydra.core.override_parser.types import Glob

    value = o.value()
    if isinstance(value, Glob):
        return list(value.filter(options))
    if o.is_sweep_override():
        return list(o.sweep_string_iterator())
    return [value if value is None else o.get_value_element_as_str()]


def _first(o: Any) -> str:
    """The override with its sweep (if any) replaced by the sweep's first value."""
    if not o.is_sweep_override():
        return str(o.input_line)
    first = next(iter(o.sweep_string_iterator()), None)
    return f"{o.get_key_element()}={first}"


def _key_problems(keys: list[Any], variants: list[list[str]], groups: set[str]) -> list[str]:
    """The keys of ``keys`` (plain ``key=value`` overrides) that no config of ``variants`` (the
    overrides each composed config gets) has, with memlab's suggestion for each."""
    from hydra import compose

    configs = []
    for overrides in variants:
        try:
            configs.append(compose(config_name="config", overrides=overrides))
        except Exception:  # noqa: BLE001 - Hydra reports it when the run composes
            return []
    errors = []
    for o in keys:
        key = o.key_or_group
        missing = [i for i, cfg in enumerate(configs) if not _has(cfg, key)]
        if not missing:
            continue
        if len(missing) < len(configs):
            choices = [" ".join(v for v in variants[i] if not v.startswith("hydra."))
                       for i in missing]
            errors.append(f"{key}={_value(o)}: not a key of the job(s) with {'; '.join(choices)} "
                          "(only of the others); run those as a sweep of their own")
            continue
        errors.append(_unknown_key(o, configs, groups))
    return errors


def _has(cfg: Any, key: str) -> bool:
    """Whether the composed ``cfg`` has the dotted ``key`` (a value of null or ??? counts)."""
    node = cfg
    for part in key.split("."):
        keys = _keys(node)
        if keys is None:
            return False
        if isinstance(keys, int):
            if not part.isdigit() or int(part) >= keys:
                return False
            node = node[int(part)]
            continue
        if part not in keys:
            return False
        node = node._get_node(part)
    return True


def _keys(node: Any) -> list[str] | int | None:
    """A mapping node's keys, a list node's length, or None for a value."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, DictConfig):
        return [str(k) for k in node.keys()]
    if isinstance(node, ListConfig):
        return len(node)
    return None


def _value(o: Any) -> str:
    return str(o.get_value_string() if o.is_sweep_override() else o.get_value_element_as_str())


def _unknown_key(o: Any, configs: list[Any], groups: set[str]) -> str:
    """memlab's message for the plain override ``o`` of a key no config of ``configs`` has."""
    from memlab.config import trl_hint

    key, value = o.key_or_group, _value(o)
    trl = trl_hint(key, value)
    if trl:
        return f"{key}={value}: {trl}"
    parts = key.split(".")
    hint, listing = None, ""
    for cfg in configs:
        parent, node = [], cfg
        for part in parts[:-1]:  # the deepest node that exists
            keys = _keys(node)
            if not isinstance(keys, list) or part not in keys:
                break
            parent.append(part)
            node = node._get_node(part)
        found = _keys(node)
        names = found if isinstance(found, list) else []
        where = ".".join(parent)
        wrong = parts[len(parent)]
        right = None
        if not parent and _under(wrong, cfg):
            right = ".".join([str(_under(wrong, cfg)), *parts])
        else:
            close = difflib.get_close_matches(
                wrong, names + (sorted(groups) if not parent else []), n=1)
            if close:
                right = ".".join([*parent, close[0], *parts[len(parent) + 1:]])
        if not listing:
            listing = (f"{where} is a list of {found}" if isinstance(found, int) else
                       f"the keys of {where}: {', '.join(sorted(names))}" if where else
                       f"the groups: {', '.join(sorted(groups))}; other keys: "
                       f"{', '.join(sorted(n for n in names if n not in groups))}")
        if right:
            hint = f"did you mean {right}={value}?"
            break
    return f"{key}={value}: unknown key; {hint or 'no key of a similar name'} ({listing})"


def _under(name: str, cfg: Any) -> str | None:
    """The first top-level node (``train``, ``method``...) that has the key ``name``."""
    tops = _keys(cfg)
    if not isinstance(tops, list):
        return None
    for top in itertools.chain(["train", "method", "measure"], tops):
        keys = _keys(cfg._get_node(top)) if top in tops else None
        if isinstance(keys, list) and name in keys:
            return top
    return None
