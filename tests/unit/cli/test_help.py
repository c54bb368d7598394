"""``memlab --help`` lists every command the dispatcher runs (and nothing it does not), and so do
tab completion and the command line's docstring: the lists are compared, so they cannot drift."""

from __future__ import annotations

import re

import pytest

from memlab.cli import main as cli


def _commands_section(text: str) -> str:
    return text.split("== Commands ==", 1)[1].split("==", 1)[0]


def _subcommands(lines: str) -> set[str]:
    """The first word after ``memlab`` on each command line that is a word (not a flag, an
    override or a placeholder)."""
    return {m.group(1) for m in re.finditer(r"^\s*memlab ([a-z][a-z-]*)(?=\s)", lines, re.M)}


def test_help_lists_every_subcommand_of_the_dispatcher(capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main(["--help"])
    assert ended.value.code in (0, None)
    section = _commands_section(capsys.readouterr().out)
    assert _subcommands(section) == set(cli.SUBCOMMANDS), section
    assert "memlab data show" in section and "memlab vllm-serve" in section
    modes = {m for m in cli.MODES if m != "train"}
    assert modes <= set(cli.SUBCOMMANDS)  # each mode= is a subcommand listed above


def test_the_docstring_and_tab_completion_name_the_same_subcommands():
    assert _subcommands(cli.__doc__ or "") == set(cli.SUBCOMMANDS)
    script = cli.completion_script("install", "bash")
    words = re.findall(r'extra="([^"]+)"', script) + re.findall(r'" ([a-z -]+) " == \*', script)
    assert len(words) == 2  # what completes after `memlab`, what starts a subcommand's words
    assert all(set(w.split()) == set(cli.SUBCOMMANDS) for w in words), words
