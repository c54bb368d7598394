"""Validation before anything loads: every numeric knob of every option declares its range and
the range is enforced, and one pass reports every problem, type errors included."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from memlab import registry
from memlab.config import MeasureConfig, TrainConfig
from memlab.context import validate
from memlab.registry import ConfigErrors, Range, from_mapping, numeric_knobs
from memlab_testing import compose


def _plain(overrides: list[str]) -> dict:
    from omegaconf import OmegaConf, open_dict

    cfg = compose(["train.device=cpu", *overrides])
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True)


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigErrors) as e:
        validate(_plain(overrides))
    return e.value.errors


def test_a_type_error_does_not_hide_the_other_problems():
    errors = _problems(["method.max_length=-1", "train.batch_size=0", "train.steps=abc",
                        "peft=qlora", "precision=fp16_mixed"])
    assert len(errors) == 5, errors
    text = "\n".join(errors)
    for needle in ("max_length: must be >= 2", "train.batch_size: must be >= 1",
                   "train.steps: must be an integer or null (got 'abc')", "peft=qlora",
                   "precision=fp16_mixed"):
        assert needle in text, (needle, errors)


def test_every_numeric_train_and_measure_knob_at_once():
    errors = _problems(["train.lr=-0.001", "optimizer.betas=[2,3]", "train.warmup_steps=-3",
                        "train.log_every=0", "train.weight_decay=-1", "train.max_grad_norm=0",
                        "train.seed=-1", "train.save_every=-1", "measure.warmup_steps=-1",
                        "measure.memory_steps=-2"])
    knobs = sorted(e.split(":")[0] for e in errors)
    assert knobs == sorted(["train.lr", "optimizer (adamw).betas", "train.warmup_steps",
                            "train.log_every",
                            "train.weight_decay", "train.max_grad_norm", "train.seed",
                            "train.save_every", "measure.warmup_steps",
                            "measure.memory_steps"]), errors
    assert "train.max_grad_norm: must be > 0 or null (got 0)" in errors
    assert "optimizer (adamw).betas: item 0 must be in [0, 1) (got [2, 3])" in errors


def _all_configs() -> list[tuple[str, type]]:
    registry.load_all()
    out = [("train", TrainConfig), ("measure", MeasureConfig)]
    for group in registry.GROUPS:
        out += [(f"{group}={name}", registry.lookup(group, name))
                for name in registry.options(group)]
    return out


def test_every_numeric_knob_declares_its_range():
    undeclared = [f"{where}.{knob}" for where, cls in _all_configs()
                  for knob, rng in numeric_knobs(cls).items() if rng is None]
    assert not undeclared, ("give these knobs a range in their annotation (memlab.registry: "
                            f"PositiveInt, NonNegativeFloat, Annotated[..., Range(...)]): "
                            f"{undeclared}")
    assert len([1 for _, cls in _all_configs() for _ in numeric_knobs(cls)]) > 100


def _outside(rng: Range, is_int: bool) -> float:
    """A value just outside ``rng`` (NaN when it is only 'finite')."""
    step = 1 if is_int else 0.5
    if rng.ge is not None:
        return rng.ge - step
    if rng.gt is not None:
        return rng.gt
    if rng.le is not None:
        return rng.le + step
    if rng.lt is not None:
        return rng.lt
    return float("nan")


def _shape(cls: type, knob: str) -> tuple[bool, bool]:
    """(is the number an int, is the knob a list of numbers)."""
    text = str(typing.get_type_hints(cls)[knob])
    return "int" in text and "float" not in text, "list" in text


@pytest.mark.parametrize("where,cls", _all_configs(), ids=[w for w, _ in _all_configs()])
def test_every_declared_range_is_enforced_and_holds_its_default(where, cls):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for knob, rng in numeric_knobs(cls).items():
        is_int, is_list = _shape(cls, knob)
        bad = _outside(rng, is_int)
        value = [bad] if is_list else bad
        obj, errors = from_mapping(cls, {knob: value}, where, partial=True)
        assert any(e.startswith(f"{where}.{knob}:") for e in errors), (knob, rng, errors)
        f = fields[knob]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        for item in (default if isinstance(default, list) else [default]):
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                assert rng.check(item) is None, f"{where}.{knob}: default {item} is {rng}"
        if obj is not None:  # partial: the bad value is replaced by the default
            assert getattr(obj, knob) == default
