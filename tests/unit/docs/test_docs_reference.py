"""The docs' generated reference (scripts/docs_reference.py, run by every docs build) covers
every registered option with every field, train / measure, and every flag of the subcommands;
a new field shows up with its type, default, range and docstring without anyone writing it."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Annotated, Literal

import pytest

from memlab.registry import Range
from memlab_testing import REPO


def _load():
    spec = importlib.util.spec_from_file_location("docs_reference",
                                                  REPO / "scripts" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref = _load()


@pytest.fixture(scope="module")
def configs():
    return ref.Configs()


@dataclasses.dataclass(kw_only=True)
class _Base:
    inherited: bool = False
    """Comes from the base class."""


@dataclasses.dataclass(kw_only=True)
class NewOption(_Base):
    chunk: Annotated[int, Range(ge=2)] | None = 1024
    """Tokens per chunk. None = the whole row."""
    mode: Literal["fast", "lean"] = "lean"
    names: list[str] = dataclasses.field(default_factory=lambda: ["a", "b"])


def test_a_new_field_appears_with_type_default_range_and_help():
    rows = {r[0]: r[1:] for r in ref.field_rows(NewOption, {"mode": "fast"})}
    assert rows["`chunk`"] == ("`int` \\| `None`", "`1024`", ">= 2",
                               "Tokens per chunk. None = the whole row.")
    assert rows["`mode`"] == ("`'fast'` \\| `'lean'`", "`fast`", "", "")  # the yaml's default
    assert rows["`names`"][1] == "`[a, b]`"
    assert rows["`inherited`"] == ("`bool`", "`false`", "", "Comes from the base class.")
    assert list(rows) == ["`inherited`", "`chunk`", "`mode`", "`names`"]


@pytest.mark.slow
def test_every_option_and_every_field_is_in_the_reference(configs):
    from memlab import config, registry

    for group in registry.GROUPS:
        text = ref.render("options", group, configs)
        for name in registry.options(group):
            assert f"### `{group}={name}`" in text
            for f in dataclasses.fields(registry.lookup(group, name)):
                assert f"| `{f.name}` |" in text, (group, name, f.name)
    for top, cls in (("train", config.TrainConfig), ("measure", config.MeasureConfig)):
        text = ref.render("options", top, configs)
        assert all(f"| `{f.name}` |" in text for f in dataclasses.fields(cls))
    # the yaml's value is the default shown: sft's yaml sets max_length
    sft = ref.render("options", "method", configs)
    assert re.search(r"\| `max_length` \| `int` \\\| `None` \| `\d+` \| >= ", sft)


@pytest.mark.parametrize("command", ref.COMMANDS)
def test_every_flag_of_the_subcommands_is_in_the_reference(command, configs):
    text = ref.render("flags", command, configs)
    parser = ref._parser(command)
    for action in parser._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}" in text, (command, flag)


def test_every_group_and_command_has_a_page_and_unknown_markers_fail(configs):
    pages = "\n".join(p.read_text() for p in (REPO / "docs").rglob("*.md"))
    seen: set[str] = set()
    for m in ref.MARKER.finditer(pages):
        seen.add(f"{m.group(1)}:{m.group(2)}")
    assert ref.required_markers() <= seen, ref.required_markers() - seen
    with pytest.raises(ValueError, match="unknown docs marker"):
        ref.expand("<!-- memlab:options nosuchgroup -->", configs)
