"""Defaults once (issue 42): every knob a shipped option yaml sets (``conf/<group>/<option>.yaml``,
and ``train:`` / ``measure:`` in conf/config.yaml) has the same default in its dataclass, so a
run composed from the yaml and an option built in code (an estimate, fit, a test) train alike."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from omegaconf import OmegaConf

from memlab.config import MeasureConfig, TrainConfig
from memlab.registry import GROUPS, load_all, lookup, options
from memlab_testing import CONF


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return value


def _differences(cls: type, node: dict[str, Any], where: str) -> list[str]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for key, value in node.items():
        if key == "name" or key not in fields:
            continue  # an unknown key is the registry's error (test_registry composes them)
        if isinstance(value, str) and "${" in value:
            continue  # an interpolation: resolved at composition, not a default
        default = _default(fields[key])
        if default is dataclasses.MISSING:
            continue  # required in code: the yaml is where it is set
        if _plain(value) != _plain(default):
            out.append(f"{where}: {key}: yaml {value!r}, {cls.__name__} {default!r}")
    return out


def test_every_option_yaml_sets_its_dataclass_defaults():
    load_all()
    problems = []
    for group in GROUPS:
        for name in options(group):
            node = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"),
                                          resolve=False)
            problems += _differences(lookup(group, name), node, f"conf/{group}/{name}.yaml")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("section", "cls"), [("train", TrainConfig), ("measure", MeasureConfig)])
def test_config_yaml_sets_the_train_and_measure_defaults(section, cls):
    node = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"), resolve=False)[section]
    problems = _differences(cls, node, f"conf/config.yaml {section}")
    assert not problems, "\n".join(problems)
